"""A call's admission: who calls (the token), what they may see (the route, a split's staged
version), and a degraded capability's last good answer when its breaker is open.

A warm call is admitted in one step (Admission.admit) on what one MGET read (call_keys()),
with no other I/O; a cache miss, a failing token or a route not in Redis is read in the pool
(Offload)."""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from agents import tokens
from agents.selectors import parse_bearer, token_authenticate_hash
from agents.throttle import FailedAuthThrottle
from agents.tokens import Principal
from capabilities.books import degraded_cache, routes
from capabilities.engine.answers import cache_target
from capabilities.engine.calls import Served
from capabilities.engine.offload import Offload
from capabilities.engine.values import CallRequest, Prefetched
from sigil import redis_keys
from sigil.errors import NotFound
from sigil.pipelined_redis import PipelinedRedis
from sigil.redis_client import get_redis


def call_keys(token_hash: str, full: str, throttle_key: str) -> tuple[str, str, str, str]:
    """What a call reads from Redis before it is forwarded, in one MGET (Prefetched's fields)."""
    return redis_keys.token(token_hash), redis_keys.route(full), redis_keys.breaker_open(full), throttle_key


@dataclass(frozen=True, slots=True, eq=False)
class Admitted:
    """A call its admission let in, built once (Admission.admit): who calls, the capability
    they called and its route as they may see it, and what the call's read found of its
    breaker. The engine serves it from here (Engine.serve) or keeps it for later (AsyncEntry)."""

    request: CallRequest
    served: Served
    full: str  # the capability called
    principal: Principal
    token_hash: str
    route: routes.CachedRoute
    breaker_raw: bytes | None  # None: closed


@dataclass(slots=True, eq=False)
class Admission:
    """Admits the calls of one engine."""

    redis: aioredis.Redis
    warm_redis: PipelinedRedis  # the warm call's own MGET
    offload: Offload
    auth_throttle: FailedAuthThrottle
    degraded_cache: degraded_cache.DegradedCache

    async def admit(self, request: CallRequest, served: Served, full: str) -> Admitted:
        """The call to `full`, admitted: its caller's principal and the route as the caller may
        see it. Raises Unauthenticated, RateLimited or NotFound."""
        if request.accepted_token_hash is not None:
            token_hash = request.accepted_token_hash
            principal, route_raw, breaker_raw = await self.accepted(token_hash, full)
        else:
            secret = parse_bearer(request.headers.get("authorization"))
            token_hash = tokens.hash_secret(secret)
            values = await self.prefetch(request, token_hash, full)
            route_raw, breaker_raw = values.route, values.breaker
            if route_raw is not None and route_raw != routes.TOMBSTONE:
                served.capability = full  # a refusal from here on is counted on the capability
            principal = await self.authenticate(request, secret, token_hash, values)
        route = await self.visible_route(served, full, principal.agent_name, route_raw)
        return Admitted(request, served, full, principal, token_hash, route, breaker_raw)

    async def prefetch(self, request: CallRequest, token_hash: str, full: str) -> Prefetched:
        """The call's read (call_keys()) in one MGET, unless its caller already made it."""
        if request.prefetched is not None:
            return request.prefetched
        keys = call_keys(token_hash, full, self.auth_throttle.key(request.address))
        try:
            return Prefetched(*await self.warm_redis.mget(keys))
        except redis.ConnectionError:
            # The held connection was closed (Redis restarted, or dropped an idle client):
            # this connects again.
            return Prefetched(*await self.warm_redis.mget(keys))

    async def authenticate(self, request: CallRequest, secret: str, token_hash: str, values: Prefetched) -> Principal:
        """The caller's principal. A usable cached token answers at once (no I/O); anything else
        (a cache miss, a failing token and the brake on its address) is the throttle's rule,
        run in the pool. Raises Unauthenticated or RateLimited."""
        if values.token is not None:
            principal = tokens.decode(token_hash, values.token, time.time())
            if principal is not None:
                return principal
        return await self.offload(
            self.auth_throttle.authenticate,
            get_redis(),
            request.address,
            secret,
            cached=values.token,
            failures=values.auth_failures,
        )

    async def accepted(self, token_hash: str, full: str) -> tuple[Principal, bytes | None, bytes | None]:
        """An accepted asynchronous call runs as the caller who sent it, if its token still
        stands (it may have been revoked since): the principal, the route and breaker read.
        Raises Unauthenticated."""
        keys = (redis_keys.token(token_hash), redis_keys.route(full), redis_keys.breaker_open(full))
        token_raw, route_raw, breaker_raw = await self.redis.mget(keys)
        principal = tokens.decode(token_hash, token_raw, time.time()) if token_raw is not None else None
        if principal is None:
            principal = await self.offload(token_authenticate_hash, token_hash, cached=token_raw)
        return principal, route_raw, breaker_raw

    async def visible_route(
        self, served: Served, full: str, caller: str, route_raw: bytes | None
    ) -> routes.CachedRoute:
        """The route of `full` as `caller` may see it; NotFound for another agent's private
        capability, an unknown or an expired one."""
        if route_raw is None:
            route_raw = await self.offload(routes.route_load, full)
        route = routes.decode(route_raw)
        if route is not None:
            served.capability = full
        if not routes.route_visible(route, caller):
            raise NotFound(f"no capability {full}")
        if route.expires_epoch is not None and route.expires_epoch <= time.time():
            raise NotFound(f"{full} has expired")
        return route

    async def split_variant(self, split: routes.Split, request: CallRequest, token_hash: str):
        """The staged version's name, route and breaker state when this caller's key falls in
        the split's share, else None. One hash of the key (the named header, else the token),
        salted with the version so each split draws its own callers; a call that goes there
        reads its route and breaker in one more MGET."""
        caller = request.headers.get(split.caller_header) if split.caller_header else None
        caller = caller or token_hash
        if zlib.crc32(f"{split.variant}|{caller}".encode()) % 100 >= split.weight:
            return None
        route_raw, breaker_raw = await self.redis.mget(
            (redis_keys.route(split.variant), redis_keys.breaker_open(split.variant))
        )
        if route_raw is None:
            route_raw = await self.offload(routes.route_load, split.variant)
        route = routes.decode(route_raw)
        return None if route is None else (split.variant, route, breaker_raw)  # None: the split just ended

    async def cached_answer(
        self, request: CallRequest, route: routes.CachedRoute, full: str, now: float
    ) -> degraded_cache.CachedAnswer | None:
        """The last good answer to this GET, for a degraded capability that opted in; else None."""
        if not route.cache_when_degraded or request.method != "GET":
            return None
        target = cache_target(request.rest, request.query)
        return await self.offload(self.degraded_cache.lookup, get_redis(), full=full, target=target, now=now)
