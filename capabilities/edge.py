"""What each key of the edge's state in Workers KV holds (docs/cloudflare.md, "The edge's
state"), computed from the database and the breakers in Redis. The encodings are the Redis
copies' own, so there is one of each:

- `tok:{hash}`: agents.selectors.token_copy (`agents/tokens.py:encode`, `-` for a revoked,
  expired or unknown token, `-disabled` for one of a disabled agent);
- `route:{full}`: `capabilities/books/routes.py:encode` with one more field, `"brk"`, the breaker
  as `capabilities/books/breaker.py:published` gives it; `-` when no capability of that name is
  left.

Each value goes with its digest in the key's metadata, so that a listing of the namespace
says what every key holds without reading it (edge_reconcile).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from agents import tokens
from agents.selectors import token_copies
from capabilities.books import breaker, routes
from capabilities.models import Capability
from sigil import redis_keys
from sigil.edge_state import ROUTE_PREFIX, TOKEN_PREFIX, route_key, token_key
from sigil.redis_client import get_redis

TOMBSTONE = routes.TOMBSTONE
# How long a tombstone stays in KV: longer than any read a location keeps (KV's cacheTtl, 60
# s by default, at most what the edge asks) plus propagation; then the key may go, and the
# edge asks the origin, which refuses the same.
TOMBSTONE_TTL_SECONDS = 86_400


def edge_values(keys: Iterable[str], *, now_epoch: float) -> dict[str, bytes]:
    """The value of each of `keys` (as named in KV) now; keys of neither kind are left out.
    Two queries and one Redis MGET per 500 keys of each kind."""
    hashes, fulls = [], []
    for key in keys:
        if key.startswith(TOKEN_PREFIX):
            hashes.append(key.removeprefix(TOKEN_PREFIX))
        elif key.startswith(ROUTE_PREFIX):
            fulls.append(key.removeprefix(ROUTE_PREFIX))
    values = {token_key(h): value for h, value in token_copies(hashes, now_epoch=now_epoch).items()} if hashes else {}
    if fulls:
        rows = routes.route_rows(fulls)
        values.update(_routes(fulls, rows))
    return values


def edge_values_all(*, now_epoch: float) -> dict[str, bytes]:
    """The value of every key Sigil knows of now: each token's, each capability's not removed."""
    values = {token_key(h): value for h, value in token_copies(None, now_epoch=now_epoch).items()}
    rows = routes.route_rows()
    values.update(_routes(list(rows), rows))
    return values


def _routes(fulls: list[str], rows: dict[str, Capability]) -> dict[str, bytes]:
    opens = get_redis().mget([redis_keys.breaker_open(full) for full in fulls]) if fulls else []
    return {route_key(full): route_value(rows.get(full), raw) for full, raw in zip(fulls, opens, strict=True)}


def route_value(capability: Capability | None, open_raw: bytes | None) -> bytes:
    """A route as the edge reads it: `routes.encode` and the breaker's `"brk"` (from its open
    key's value, `open_raw`); the tombstone for no capability."""
    if capability is None:
        return TOMBSTONE
    route = json.loads(routes.encode(capability))
    route["brk"] = breaker.published(open_raw)
    return json.dumps(route, separators=(",", ":")).encode()


def is_tombstone(value: bytes) -> bool:
    """Whether `value` says "gone" (a route's or a token's tombstone)."""
    return value in (routes.TOMBSTONE, tokens.TOMBSTONE)


def digest(value: bytes) -> str:
    """What a key's metadata says of its value (`{"sha": digest}`): enough to tell two values
    apart in a listing, short enough for KV's 1024 bytes of metadata."""
    return hashlib.sha256(value).hexdigest()[:32]
