"""The mark Sigil's edge puts on a call it hands the origin (a handoff) (capabilities/runtimes/edge/edge.js,
`edgeMark`): the caller's address as Cloudflare saw it, signed with a key only Sigil's server
and its Workers hold, so that the origin may take that address for the caller's (the
failed-token brake counts per address; without the mark every call through the edge would come
from Cloudflare's). A mark that does not verify is ignored: the call is served as any other."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

MARK = "x-sigil-edge"
CLIENT = f"{MARK}-client"
AT = f"{MARK}-at"
SIGNATURE = f"{MARK}-signature"
# How far a mark's time may be from the origin's clock, either way, as for a push of call
# records: a captured mark cannot be replayed for longer, and clocks need not agree better.
MAX_SKEW_SECONDS = 300


def handoff_key(secret: str) -> str:
    """The key the edge signs its marks with, derived from SIGIL_INTERNAL_SECRET (its Workers
    are given this, not the secret, for the marks)."""
    return hmac.new(secret.encode(), b"sigil edge mark", hashlib.sha256).hexdigest()


def handoff_signature(key: str, *, at: str, client: str, method: str, path: str) -> str:
    """The signature edge.js writes, as the Workers sign what they push to the origin
    (capabilities/record_pushes.py): the hex HMAC-SHA256 of the time of signing, a dot, and
    what is signed: here the address, the method and the path, a line each."""
    message = f"{at}.{client}\n{method}\n{path}".encode(errors="replace")
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def handoff_client(headers: Mapping[str, str], *, method: str, path: str, key: str, now: float) -> str | None:
    """The caller's address a valid mark names (`headers` with lower-case names), or None when
    the request carries no mark, or one that does not verify or is too old."""
    if headers.get(MARK) != "1":
        return None
    client, at, given = headers.get(CLIENT, ""), headers.get(AT, ""), headers.get(SIGNATURE, "")
    try:
        if abs(now - int(at)) > MAX_SKEW_SECONDS:
            return None
    except ValueError:
        return None
    expected = handoff_signature(key, at=at, client=client, method=method, path=path)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        return None
    return client or None
