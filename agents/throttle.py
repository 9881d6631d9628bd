"""Throttling of failed authentication per client address, shared by every process through
Redis.

An address that sent SIGIL_AUTH_FAILURE_LIMIT tokens that fail (unknown, revoked, expired,
or a wrong /metrics token) within SIGIL_AUTH_FAILURE_WINDOW_SECONDS has its further failing
tokens answered `429 rate_limited`, with Retry-After, on the API, on calls and on /metrics
until that window ends. The brake stops guesses only: a token that authenticates is always
served, whatever its address sent before, since agents share addresses (the owner's machine,
one NAT) and one agent's stale token must not lock out the others. The window starts at the
first failure (a fixed window, one Redis key per address).

Written here rather than taken from a library: the engine is no Django view, and the count
must ride in the engine's one MGET so that a valid warm call pays no extra Redis
round trip. The owner's admin login has its own lockout (django-axes, see settings).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

import redis
from django.conf import settings

from agents.selectors import token_authenticate
from agents.tokens import Principal, stamp_used
from sigil import redis_keys
from sigil.configured import FromSettings, setting
from sigil.errors import RateLimited, Unauthenticated


def client_address(meta: Mapping[str, str], *, proxies: int) -> str:
    """The caller's address: REMOTE_ADDR, or behind `proxies` trusted proxies the address
    the outermost of them saw (each appends one to X-Forwarded-For; earlier ones are the
    caller's to forge)."""
    if proxies:
        forwarded = [part.strip() for part in meta.get("HTTP_X_FORWARDED_FOR", "").split(",")]
        forwarded = [part for part in forwarded if part]
        if len(forwarded) >= proxies:
            return forwarded[-proxies]
    return meta.get("REMOTE_ADDR", "")


def request_client_address(request) -> str:
    """client_address() of a Django request (django-axes' AXES_CLIENT_IP_CALLABLE)."""
    return client_address(request.META, proxies=settings.SIGIL_TRUSTED_PROXY_COUNT)


@dataclass(frozen=True, kw_only=True)
class FailedAuthThrottle(FromSettings):
    """The failure count of client addresses, read with the caller's own Redis reads."""

    limit: int = setting("SIGIL_AUTH_FAILURE_LIMIT")
    window_seconds: int = setting("SIGIL_AUTH_FAILURE_WINDOW_SECONDS")
    proxies: int = setting("SIGIL_TRUSTED_PROXY_COUNT")

    def address(self, meta: Mapping[str, str]) -> str:
        return client_address(meta, proxies=self.proxies)

    @staticmethod
    def key(address: str) -> str:
        return redis_keys.auth_failures(address)

    def check(self, client: redis.Redis, address: str, failures: bytes | None) -> None:
        """Raise RateLimited when `failures` (the value of key(address), read by the caller
        in its own round trip) has reached the limit; a limit of 0 never does."""
        if failures is None or not self.limit or int(failures) < self.limit:
            return
        left_ms = max(client.pttl(self.key(address)), 1000)
        raise RateLimited(
            f"too many failed authentications from {address}; retry later",
            retry_after=left_ms / 1000,
        )

    def failed(self, client: redis.Redis, address: str) -> None:
        """Count one failed authentication of `address` (one round trip)."""
        if not self.limit:
            return
        pipe = client.pipeline(transaction=False)
        pipe.set(self.key(address), 0, ex=self.window_seconds, nx=True)
        pipe.incr(self.key(address))
        pipe.execute()

    def verify_shared_secret(
        self, client: redis.Redis, address: str, given: str, expected: str, *, refusal: str
    ) -> None:
        """Check `given` against a shared secret (the metrics token) under the same brake as
        agents' tokens, in the same count: a wrong one counts against `address` and is
        Unauthenticated (saying `refusal`), or RateLimited once `address` is over the limit.
        The right one always passes. One Redis round trip for a wrong one, none for the right one."""
        if hmac.compare_digest(given.encode(), expected.encode()):
            return
        self.check(client, address, client.get(self.key(address)))
        self.failed(client, address)
        raise Unauthenticated(refusal)

    def authenticate(
        self,
        client: redis.Redis,
        address: str,
        secret: str,
        *,
        cached: bytes | None,
        failures: bytes | None,
        stamp: bool = True,
    ) -> Principal:
        """The principal of `secret`. A token that fails counts against `address`, and once
        `address` is over the limit it is answered RateLimited instead of Unauthenticated.
        `cached` and `failures` are the token's cache entry and key(address), read by the
        caller in its own round trip. A token that stands is stamped as used
        (agents.tokens.stamp_used: at most once a minute per process) unless `stamp` is False,
        for a caller that stamps on its own. Raises Unauthenticated or RateLimited."""
        try:
            principal = token_authenticate(secret, cached=cached)
        except Unauthenticated:
            self.check(client, address, failures)
            self.failed(client, address)
            raise
        if stamp:
            stamp_used(client, principal.token_hash)
        return principal
