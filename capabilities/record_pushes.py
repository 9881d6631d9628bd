"""How Sigil's Workers on Cloudflare push call records to the origin, and how the origin tells
a push of theirs from anyone else's: the endpoint, the signing key, the signature and how
fresh it must be.

The Worker's side is `capabilities/runtimes/host/host.js` (push): it signs each batch with
HMAC-SHA256, keyed by a key derived from SIGIL_INTERNAL_SECRET (given to the Worker as a
secret_text binding: the Worker never holds the internal secret itself), over the time of
signing and the exact body, and sends both in headers. The origin's side is
`capabilities/services/call_records.py:call_records_push`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from sigil.errors import Forbidden

#: the origin's endpoint, under SIGIL_ORIGIN_URL (sigil_site/urls.py serves it)
PUSH_PATH = "_call-records"
SIGNED_AT_HEADER = "X-Sigil-Signed-At"
SIGNATURE_HEADER = "X-Sigil-Signature"
# A push is taken within this long of its signing, either way (clocks differ a little); a
# captured one replayed later is refused, and within it the batch's id makes it a no-op.
MAX_AGE_SECONDS = 300
# The Worker's bindings: where to push, and the key to sign with.
URL_BINDING = "SIGIL_RECORDS_URL"
KEY_BINDING = "SIGIL_RECORDS_KEY"


def push_key(secret: str) -> str:
    """The key pushes are signed with, derived from the internal secret `secret`: a Worker
    holding it can sign call records, and nothing else."""
    return hmac.new(secret.encode(), b"sigil call records push", hashlib.sha256).hexdigest()


def push_signature(*, key: str, signed_at: str, body: bytes) -> str:
    """The hex HMAC-SHA256 of `signed_at`, a dot and `body`, keyed by `key` (as host.js signs)."""
    return hmac.new(key.encode(), signed_at.encode() + b"." + body, hashlib.sha256).hexdigest()


def push_verify(*, key: str, signed_at: str, signature: str, body: bytes, now: float) -> None:
    """Check that `body` was signed with `key` at `signed_at` (epoch seconds), within
    MAX_AGE_SECONDS of `now`. Raises Forbidden naming what is wrong."""
    try:
        at = int(signed_at)
    except ValueError:
        raise Forbidden(f"a push says when it was signed ({SIGNED_AT_HEADER}, epoch seconds)") from None
    expected = push_signature(key=key, signed_at=signed_at, body=body)
    if not hmac.compare_digest(expected.encode(), signature.strip().lower().encode()):
        raise Forbidden(f"the push's signature ({SIGNATURE_HEADER}) does not match its body")
    if abs(now - at) > MAX_AGE_SECONDS:
        raise Forbidden(
            f"the push was signed {abs(now - at):.0f} s {'ago' if at < now else 'ahead'}; "
            f"one is taken within {MAX_AGE_SECONDS} s of its signing"
        )


@dataclass(frozen=True)
class RecordsOrigin:
    """Where Sigil's Workers on Cloudflare push call records (`url`, the endpoint) and the key
    they sign them with."""

    url: str
    key: str

    @classmethod
    def from_settings(cls) -> RecordsOrigin | None:
        """From SIGIL_ORIGIN_URL and SIGIL_INTERNAL_SECRET; None when no origin is set (call
        records cannot arrive) or call records are off."""
        from django.conf import settings

        if not settings.SIGIL_ORIGIN_URL or not settings.SIGIL_LOGS_ENABLED:
            return None
        return cls.at(settings.SIGIL_ORIGIN_URL, secret=settings.SIGIL_INTERNAL_SECRET)

    @classmethod
    def at(cls, origin_url: str, *, secret: str) -> RecordsOrigin:
        """The endpoint under `origin_url`, signed for with the key derived from `secret`."""
        return cls(url=f"{origin_url.rstrip('/')}/{PUSH_PATH}", key=push_key(secret))

    def bindings(self) -> list[dict]:
        """The Worker's binding naming the endpoint (plain text)."""
        return [{"type": "plain_text", "name": URL_BINDING, "text": self.url}]

    def secret_bindings(self) -> list[dict]:
        """The Worker's binding holding the key (a secret)."""
        return [{"type": "secret_text", "name": KEY_BINDING, "text": self.key}]
