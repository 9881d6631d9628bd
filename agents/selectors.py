"""Reads on agents and tokens."""

from __future__ import annotations

import time
from collections.abc import Iterable

from agents import tokens
from agents.models import Agent, Token
from agents.tokens import Principal
from sigil import redis_keys
from sigil.errors import NotFound, Unauthenticated
from sigil.redis_client import get_redis


def token_authenticate(secret: str, *, cached: bytes | None = None) -> Principal:
    """The principal a bearer secret stands for. Raises Unauthenticated.

    Redis answers on a warm call (no SQL); a miss reads the database once and fills the
    cache with SET NX so that it never overwrites a revocation. `cached` lets the engine
    pass a value it fetched in its own batched round trip.
    """
    return token_authenticate_hash(tokens.hash_secret(secret), cached=cached)


def token_authenticate_hash(token_hash: str, *, cached: bytes | None = None) -> Principal:
    """The principal a token stands for, by its hash: for a call accepted earlier, whose
    secret Sigil did not keep, so that a token revoked since stops it. Raises Unauthenticated."""
    now = time.time()
    if cached is None:
        cached = get_redis().get(redis_keys.token(token_hash))
    if cached is None:
        cached = _fill_cache(token_hash)
    principal = tokens.decode(token_hash, cached, now)
    if principal is None and cached == tokens.DISABLED:
        raise Unauthenticated("the owner disabled this token's agent: its tokens work again once the owner enables it")
    if principal is None:
        raise Unauthenticated("the token is unknown, revoked or expired: ask the owner for a new one")
    return principal


def _fill_cache(token_hash: str) -> bytes:
    token = Token.objects.select_related("agent").filter(secret_hash=token_hash).first()
    value = token_copy(token, now_epoch=time.time())
    ttl = tokens.NEGATIVE_TTL_SECONDS if value in tokens.REFUSALS else tokens.POSITIVE_TTL_SECONDS
    key = redis_keys.token(token_hash)
    redis = get_redis()
    if not redis.set(key, value, ex=ttl, nx=True):
        value = redis.get(key) or value
    return value


def token_copy(token: Token | None, *, now_epoch: float) -> bytes:
    """What a token's copies hold at `now_epoch` (its Redis copy, and the edge's in Workers
    KV): `tokens.encode` of a usable token of an active agent; `tokens.DISABLED` for a token
    of a disabled agent that is not revoked; `tokens.TOMBSTONE` for a revoked, expired or
    unknown (None) one. `token` comes with its agent (select_related)."""
    state = token.state(now_epoch) if token is not None else tokens.TokenState.REVOKED
    if state == tokens.TokenState.REVOKED:  # or unknown
        return tokens.TOMBSTONE
    if not token.agent.is_active:
        return tokens.DISABLED
    if state == tokens.TokenState.EXPIRED:
        return tokens.TOMBSTONE
    return tokens.encode(
        token.agent_id,
        token.agent.name,
        token.scope,
        token.expires_at.timestamp() if token.expires_at else None,
        calls_in_flight=token.agent.max_calls_in_flight,
        placements_in_flight=token.agent.max_placements_in_flight,
    )


# Hashes looked up in one query: well within every database's limit on a query's parameters.
COPIES_PER_QUERY = 500


def token_copies(hashes: Iterable[str] | None, *, now_epoch: float) -> dict[str, bytes]:
    """token_copy of each token by its hash (those of no token: the tombstone); of every
    token when `hashes` is None. One query per COPIES_PER_QUERY hashes."""
    rows = Token.objects.select_related("agent")
    if hashes is None:
        return {token.secret_hash: token_copy(token, now_epoch=now_epoch) for token in rows}
    wanted = sorted(set(hashes))
    found: dict[str, Token] = {}
    for start in range(0, len(wanted), COPIES_PER_QUERY):
        chunk = wanted[start : start + COPIES_PER_QUERY]
        found.update((token.secret_hash, token) for token in rows.filter(secret_hash__in=chunk))
    return {token_hash: token_copy(found.get(token_hash), now_epoch=now_epoch) for token_hash in wanted}


def parse_bearer(header: str | None) -> str:
    """The secret in an `Authorization: Bearer ...` header. Raises Unauthenticated."""
    if not header:
        raise Unauthenticated("send Authorization: Bearer <token>")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthenticated("send Authorization: Bearer <token>")
    return secret.strip()


def agent_named(name: str) -> Agent:
    """The agent of that name. Raises NotFound."""
    agent = Agent.objects.filter(name=name).first()
    if agent is None:
        raise NotFound(f"no agent {name!r}")
    return agent
