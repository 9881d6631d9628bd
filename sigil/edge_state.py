"""The state Sigil publishes to its edge in Workers KV (docs/cloudflare.md, "The edge's state"):
the names of its keys, and the marks of the keys to publish again.

Every writer of a Redis copy the edge mirrors (a route, a token, a breaker's state) marks its
key here once its write has committed; the publisher (capabilities/services/edge.py) takes the
marked keys and writes each one's value as the database has it then. It imports no app, so
that agents and capabilities mark alike; each key's value is capabilities/edge.py's.
"""

from __future__ import annotations

import functools

from django.conf import settings
from django.db import transaction

from sigil import redis_keys
from sigil.redis_client import get_redis

TOKEN_PREFIX = "tok:"
ROUTE_PREFIX = "route:"


def token_key(token_hash: str) -> str:
    """The key of a token's state: `tok:{sha256 hex of the token}`."""
    return TOKEN_PREFIX + token_hash


def route_key(full: str) -> str:
    """The key of a capability's route (a split's staged version's too): `route:{full}`."""
    return ROUTE_PREFIX + full


def edge_mark(*keys: str) -> None:
    """Mark `keys` to be published again, once the current transaction commits (at once
    outside one), when the edge is on (SIGIL_EDGE); nothing otherwise. One Redis command.
    Idempotent: a key marked twice is published once."""
    if keys and settings.SIGIL_EDGE:
        transaction.on_commit(functools.partial(_mark, keys))


def _mark(keys: tuple[str, ...]) -> None:
    get_redis().sadd(redis_keys.EDGE_DIRTY, *keys)
