"""The call path: a CallRequest to the capability's code, and its CallAnswer, on an event loop.

A call holds no thread while it waits: on its capability, on a page-in, on another process's
placement lock, on Cloudflare. On a warm call it does no SQL and two Redis round trips: one
MGET before (the token, the route, the breaker and the caller's failed-token count:
call_keys()), one script call after the answer was sent (stats.CallRecord). An answer the
capability's code did not give (a refusal: 401, 404, 429, 503 degraded, ...) is counted in one
more round trip. What blocks by nature (the ORM on the cold path, a placement, the Cloudflare
client, a Celery enqueue) runs in a bounded pool of threads (Offload), never on the loop.

Every answer carries `X-Request-Id`, the id that names it in the access log, the failure
record and any logged traceback; the capability receives it as the same header.

Each agent gets a fair share of the process (engine.shares): a call over its agent's cap on
calls in flight, placements under way or body bytes in flight is `429 rate_limited`, and the
other agents notice nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import redis
import redis.asyncio as aioredis
from django.conf import settings
from django.db import close_old_connections
from urllib3.util import parse_url

from agents import tokens
from agents.selectors import parse_bearer, token_authenticate_hash
from agents.throttle import FailedAuthThrottle
from agents.tokens import Principal
from capabilities import breaker, degraded_cache, failures, names, pager, routes, stats
from capabilities.engine.shares import FairShares
from capabilities.engine.upstream import (
    HOP_BY_HOP,
    UpstreamClient,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from capabilities.engine.values import CallAnswer, CallRequest, Prefetched
from capabilities.runtimes import get_runtime, runtime_for
from capabilities.runtimes.base import SERVED_VERSION_HEADER, Route
from capabilities.runtimes.errors import RuntimeThrottled, RuntimeUnavailable
from capabilities.services.observability import breaker_changed, breaker_enter
from sigil import leases
from sigil.errors import (
    REDIS_UNREACHABLE,
    CapabilityError,
    Degraded,
    InternalError,
    InvalidRequest,
    NotFound,
    SigilError,
    Timeout,
    TooLarge,
    Unavailable,
    UpstreamError,
    error_body,
    error_for_unexpected,
    error_headers,
)
from sigil.redis_client import SOCKET_TIMEOUT_SECONDS, get_redis

logger = logging.getLogger("capabilities.gateway")
access_logger = logging.getLogger("sigil.access")

# What the engine drops from the caller's request besides hop-by-hop fields: the caller's
# credentials, the length it writes itself, and (below) anything posing as Sigil's internal
# headers. The caller's Host goes on (the capability's request.url names the host it was
# called at), unless the route names the host its runtime needs.
DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {"authorization", "content-length"}
# Cloudflare stopped the capability at its limits. Sigil's own Workers answer `exceeded-cpu`
# (with "ran past its CPU limit of N ms") when they see it; an unmarked 1102, which does not
# say whether CPU or memory ran out, is read as EXCEEDED_LIMITS (Runtime.stopped_at_limits).
EXCEEDED_CPU = "exceeded-cpu"
EXCEEDED_LIMITS = "exceeded-limits"
# On every answer the engine writes itself (never on a capability's own responses, which
# pass through unchanged): a browser must not guess a type other than the one sent.
NOSNIFF = ("X-Content-Type-Options", "nosniff")
# How a call to a script it has just placed waits for Cloudflare to propagate it: the first
# pause, doubled after each "not found" up to the longest.
PROPAGATION_FIRST_PAUSE_SECONDS = 0.05
PROPAGATION_MAX_PAUSE_SECONDS = 1.0
# How a call watches another call's (or process's) placement of its capability.
PLACEMENT_POLL_FIRST_SECONDS = 0.01
PLACEMENT_POLL_MAX_SECONDS = 0.2


def call_keys(token_hash: str, full: str, throttle_key: str) -> tuple[str, str, str, str]:
    """What a call reads from Redis before it is forwarded, in one MGET (Prefetched's fields)."""
    return tokens.cache_key(token_hash), routes.key(full), breaker.open_key(full), throttle_key


class Offload:
    """The bounded pool in which the engine runs what blocks; each job closes the database
    connections Django would close after a request (CONN_MAX_AGE), as no Django handler runs
    here."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sigil-offload")

    async def __call__(self, function: Callable, /, *args, **kwargs) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, _job, function, args, kwargs)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _job(function: Callable, args: tuple, kwargs: dict) -> Any:
    close_old_connections()
    try:
        return function(*args, **kwargs)
    finally:
        close_old_connections()


class Call:
    """What one call holds while it is served, and must give back however it ends."""

    __slots__ = (
        "body_size",
        "caller",
        "capability_type",
        "finished",
        "full",
        "holds_call_share",
        "inflight_process",
        "is_trial",
        "owner",
        "page_in_ms",
        "recorded",
        "request_id",
        "sent_at",
        "shown",
        "started",
        "token_hash",
        "version",
    )

    def __init__(self, full: str, capability_type: str, token_hash: str, started: float, request_id: str) -> None:
        self.full = full  # what is placed, counted and broken: a staged version's own name in a split
        self.shown = full  # the capability the caller called
        self.capability_type = capability_type
        self.token_hash = token_hash
        self.started = started
        self.request_id = request_id
        self.is_trial = False
        self.inflight_process: str | None = None  # whose in-flight count it holds, if any
        self.holds_call_share = False
        self.finished = False
        self.recorded = False  # counted as a call (finish), not as a refusal
        self.page_in_ms: float | None = None
        self.sent_at = 0.0  # epoch the request left for the runtime
        self.version: int | None = None  # the version number of the code that answered
        self.caller = ""
        self.owner = ""
        self.body_size = 0  # request-body bytes counted against the owner's share


class Served:
    """Where a call stands as it goes through the engine: what the edge needs to count and log
    it however it ends."""

    __slots__ = ("call", "capability")

    def __init__(self) -> None:
        self.capability: str | None = None  # set once the path names a registered capability
        self.call: Call | None = None


class Engine:
    """One per process (per event loop): the runtime, the Redis clients, the upstream pools,
    the fair shares and the pool for blocking work."""

    def __init__(self) -> None:
        self.redis = aioredis.Redis.from_url(
            settings.REDIS_URL,
            socket_timeout=SOCKET_TIMEOUT_SECONDS,
            socket_connect_timeout=SOCKET_TIMEOUT_SECONDS,
            health_check_interval=30,
        )
        self.runtime = get_runtime()
        self.record_script = self.redis.register_script(stats.RECORD_CALL)
        self.max_body = settings.SIGIL_INVOKE_MAX_BODY_BYTES
        self.async_max_body = settings.SIGIL_ASYNC_MAX_BODY_BYTES
        self.failures_kept = settings.SIGIL_FAILURES_KEPT
        self.access_log_length = settings.SIGIL_ACCESS_PATTERN_MAX_CALLS
        self.placement_lock_seconds = settings.SIGIL_PLACEMENT_LOCK_SECONDS
        self.degraded_cache = degraded_cache.DegradedCache.from_settings()
        self.breaker = breaker.Breaker.from_settings()
        # The pager deletes a victim only once no call to it is in flight; unbounded
        # runtimes never page out, so they skip the counting.
        self.tracks_inflight = self.runtime.total_slots is not None
        self.upstream = UpstreamClient(connect_timeout=5.0, read_timeout=settings.SIGIL_INVOKE_TIMEOUT_SECONDS)
        self.route_memo: dict[tuple, Route] = {}
        self.placing: dict[str, asyncio.Future] = {}  # this process's placements under way
        self.auth_throttle = FailedAuthThrottle.from_settings()
        self.shares = FairShares.from_settings()
        self.offload = Offload(settings.SIGIL_ENGINE_SYNC_THREADS)

    async def aclose(self) -> None:
        await self.upstream.close()
        await self.redis.aclose()
        self.offload.shutdown()

    # The edge.

    async def call(self, request: CallRequest) -> CallAnswer:
        """The answer to `request`, in the contract whatever happens: a bug or an unreachable
        Redis still gets the envelope and its access-log line."""
        started = time.perf_counter()
        served = Served()
        code = None
        redis_down = False
        try:
            answer = await self.handle(request, served, started)
        except SigilError as error:
            code = error.code
            answer = error_answer(error)
        except asyncio.CancelledError:  # the caller or the runner gave up: give back what it holds
            if served.call is not None and not served.call.finished:
                await self.abandon(served.call)
            raise
        except Exception as exc:
            error = _unexpected(request, exc)
            code = error.code
            redis_down = isinstance(exc, REDIS_UNREACHABLE)
            answer = error_answer(error)
        call = served.call
        if call is not None and not call.finished:
            await self.abandon(call)
        answer.headers.append(("X-Request-Id", request.request_id))
        if answer.on_close is None:  # an answer of Sigil's own: counted and logged now
            # Counting needs the Redis that just failed: a hung one would hold the answer twice.
            if (call is None or not call.recorded) and not redis_down:
                await self.count_answer(served.capability, answer.status, code)
            log_access(request, answer.status, started, capability=served.capability, page_in_ms=None, code=code)
        return answer

    async def handle(self, request: CallRequest, served: Served, started: float) -> CallAnswer:
        try:
            names.validate_agent_name(request.agent)
            names.validate_capability_name(request.name, ephemeral=True)
        except InvalidRequest as exc:
            raise NotFound(f"no capability at {quote(f'/{request.agent}/{request.name}')}") from exc
        if request.length is not None and request.length < 0:
            raise InvalidRequest("Content-Length is not a number")
        full = names.full_name(request.agent, request.name)
        if request.accepted_token_hash is not None:
            # Run as the caller who sent it, if its token still stands (it may have been revoked since).
            token_hash = request.accepted_token_hash
            keys = (tokens.cache_key(token_hash), routes.key(full), breaker.open_key(full))
            token_raw, route_raw, breaker_raw = await self.redis.mget(keys)
            principal = tokens.decode(token_hash, token_raw, time.time()) if token_raw is not None else None
            if principal is None:
                principal = await self.offload(token_authenticate_hash, token_hash, cached=token_raw)
        else:
            secret = parse_bearer(request.headers.get("authorization"))
            token_hash = tokens.hash_secret(secret)
            values = request.prefetched
            if values is None:
                keys = call_keys(token_hash, full, self.auth_throttle.key(request.address))
                values = Prefetched(*await self.mget(keys))
            route_raw, breaker_raw = values.route, values.breaker
            if route_raw is not None and route_raw != routes.TOMBSTONE:
                served.capability = full  # a refusal from here on is counted on the capability
            principal = await self.authenticate(request, secret, token_hash, values)
            if _prefers_async(request):
                return await self.accept(request, served, full, principal, token_hash, route_raw)
        return await self.serve(request, served, started, full, principal, token_hash, route_raw, breaker_raw)

    async def mget(self, keys) -> list:
        try:
            return await self.redis.mget(keys)
        except redis.ConnectionError:
            # The held connection was closed (Redis restarted, or dropped an idle client);
            # redis-py has discarded it, so this reconnects.
            return await self.redis.mget(keys)

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

    async def visible_route(self, served: Served, full: str, caller: str, route_raw: bytes | None):
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

    async def serve(
        self, request, served: Served, started, full, principal: Principal, token_hash, route_raw, breaker_raw
    ) -> CallAnswer:
        """From the route on: the breaker, the shares, the page-in when cold, the call."""
        route = await self.visible_route(served, full, principal.agent_name, route_raw)
        called = full
        if route.split is not None:
            chosen = await self.split_variant(route.split, request, token_hash)
            if chosen is not None:
                full, route, breaker_raw = chosen
                served.capability = full  # a refusal of the staged version is counted on it
        now = time.time()
        is_trial = False
        if breaker_raw is not None:  # not closed: open, half-open or forced
            try:
                is_trial = await self.offload(
                    breaker_enter, self.breaker, get_redis(), full=full, raw=breaker_raw, now=now
                )
            except Degraded:
                cached = await self.cached_answer(request, route, full, now)
                if cached is None:
                    raise
                return cached_reply(cached, now)
        call = served.call = Call(full, route.type, token_hash, started, request.request_id)
        call.is_trial = is_trial
        call.shown = called
        call.caller = principal.agent_name
        call.owner = route.agent
        self.shares.take_call(principal)
        call.holds_call_share = True
        return await self.forward(request, call, route, principal)

    async def split_variant(self, split: routes.Split, request: CallRequest, token_hash: str):
        """The staged version's name, route and breaker state when this caller's key falls in
        the split's share, else None. One hash of the key (the named header, else the token),
        salted with the version so each split draws its own callers; a call that goes there
        reads its route and breaker in one more MGET."""
        caller = request.headers.get(split.caller_header) if split.caller_header else None
        caller = caller or token_hash
        if zlib.crc32(f"{split.variant}|{caller}".encode()) % 100 >= split.weight:
            return None
        route_raw, breaker_raw = await self.redis.mget((routes.key(split.variant), breaker.open_key(split.variant)))
        if route_raw is None:
            route_raw = await self.offload(routes.route_load, split.variant)
        route = routes.decode(route_raw)
        return None if route is None else (split.variant, route, breaker_raw)  # None: the split just ended

    async def forward(self, request: CallRequest, call: Call, route: routes.CachedRoute, principal: Principal):
        page_in_ms = None
        # An accepted asynchronous call has no caller waiting: it waits out a placement under
        # way as long as the placement may take, not as long as a call may.
        wait = None if request.accepted_token_hash is not None else self.upstream.read_timeout
        if route.state not in routes.SERVED_STATES:
            route, page_in_ms = await self.page_in(call.full, principal, wait_seconds=wait)
        call.version = route.version
        target = await self.target(route)
        if target.redirect:
            return self.reply_redirect(call, target, request, page_in_ms)
        if request.length:
            if request.length > self.max_body:
                raise TooLarge(f"the request body is over {self.max_body} bytes")
            self.shares.take_body(call.owner, request.length)
            call.body_size = request.length
        if self.tracks_inflight:
            # Counted per process (pager.pager_inflight_enter): a count of a process that died
            # stops holding up the page-out.
            pipe = self.redis.pipeline(transaction=False)
            process = leases.mark_live(pipe)
            pipe.hincrby(pager.inflight_by_process_key(call.full), process, 1)
            await pipe.execute()
            call.inflight_process = process
        if request.websocket:
            return await self.open_websocket(request, call, route, target, page_in_ms)

        upstream_started = time.perf_counter()
        upstream = await self.send_once(request, call, route)
        # Every runtime's "script gone" answer is a 404: other calls skip the check.
        missed = upstream.status == 404 and runtime_for(route.backend).is_missing(upstream)
        if page_in_ms is None and missed and not request.has_body:
            # The runtime lost a script Sigil thought live: a miss after all (or the route
            # was out of date: a switch of runtime moved it). Page it in and retry once
            # (only bodiless calls: a body cannot be sent twice).
            await upstream.drain()
            upstream.release()
            from capabilities.services import capability_mark_missing

            await self.offload(capability_mark_missing, full=call.full, slot=route.slot, backend=route.backend)
            route, page_in_ms = await self.page_in(call.full, principal, wait_seconds=wait)
            call.version = route.version
            upstream_started = time.perf_counter()
            upstream = await self.send_once(request, call, route)
            missed = upstream.status == 404 and runtime_for(route.backend).is_missing(upstream)
        if missed and page_in_ms is not None and not request.has_body:
            upstream = await self.resend_while_propagating(request, call, route, upstream)
        upstream_ms = (time.perf_counter() - upstream_started) * 1000
        call.page_in_ms = page_in_ms

        # The placed code names its own version where the runtime replaces code in place
        # (worker-pool, platform): the header is then the truth, not the route's.
        served = upstream.headers.get(SERVED_VERSION_HEADER)
        if served is not None and served.isdigit():
            call.version = int(served)
        failure = upstream.headers.get("x-sigil-error")
        if failure is None and upstream.status == 503 and runtime_for(route.backend).stopped_at_limits(upstream):
            failure = EXCEEDED_LIMITS
        if failure is not None:
            return await self.runtime_failure(upstream, failure, call)

        headers = [
            (k, v)
            for k, v in upstream.header_pairs()
            if k.lower() not in HOP_BY_HOP and not k.lower().startswith("x-sigil-")
        ]
        headers.extend(self.sigil_headers(call, route, started=call.started, upstream_ms=upstream_ms))
        call.finished = True  # from here the answer's close() records the call
        body = AnswerBody(self, upstream, call, route, request)
        if route.cache_when_degraded and request.method == "GET" and 200 <= upstream.status < 300:
            body.keep_for_cache(
                cache_target(request.rest, request.query),
                degraded_cache.CachedAnswer(
                    status=upstream.status,
                    reason=upstream.reason,
                    headers=[(k, v) for k, v in headers if k.lower() not in ("content-length", "server-timing")],
                    body=b"",
                    stored_epoch=0.0,
                ),
            )
        return CallAnswer(upstream.status, upstream.reason, headers, body.stream(), on_close=body.close)

    @staticmethod
    def sigil_headers(call: Call, route: routes.CachedRoute, *, started: float, upstream_ms: float) -> list:
        page_in_ms = call.page_in_ms
        sigil_ms = (time.perf_counter() - started) * 1000 - upstream_ms - (page_in_ms or 0)
        timing = f"sigil;dur={sigil_ms:.2f}, capability;dur={upstream_ms:.2f}"
        headers = [("X-Sigil-Capability", call.shown)]
        if call.version is not None:
            headers.append(("X-Sigil-Version", str(call.version)))
        if page_in_ms is not None:
            headers.append(("X-Sigil-Cold-Start", "1"))
            timing += f", page-in;dur={page_in_ms:.2f}"
        headers.append(("Server-Timing", timing))
        return headers

    async def cached_answer(self, request: CallRequest, route, full: str, now: float):
        """The last good answer to this GET, for a degraded capability that opted in; else None."""
        if not route.cache_when_degraded or request.method != "GET":
            return None
        target = cache_target(request.rest, request.query)
        return await self.offload(self.degraded_cache.lookup, get_redis(), full=full, target=target, now=now)

    async def resend_while_propagating(self, request, call: Call, route, upstream: UpstreamResponse):
        """Send a bodiless call again while the script this call just placed (or Sigil's own
        Worker in front of it, deployed by that placement) still answers "not found": Cloudflare
        serves a new Worker, and a workers.dev route just turned on, only once they have
        propagated. Backs off, within the call's time (SIGIL_INVOKE_TIMEOUT_SECONDS); the last
        answer is the caller's. Nothing ran the capability's code meanwhile, so resending is safe."""
        runtime = runtime_for(route.backend)
        deadline = call.started + self.upstream.read_timeout
        pause = PROPAGATION_FIRST_PAUSE_SECONDS
        while time.perf_counter() + pause < deadline:
            await upstream.drain()
            upstream.release()
            await asyncio.sleep(pause)
            pause = min(pause * 2, PROPAGATION_MAX_PAUSE_SECONDS)
            upstream = await self.send_once(request, call, route)
            if not (upstream.status == 404 and runtime.is_missing(upstream)):
                break
        return upstream

    async def page_in(
        self, full: str, principal: Principal, *, wait_seconds: float | None
    ) -> tuple[routes.CachedRoute, float]:
        """Place `full`, or wait for the placement under way (at most `wait_seconds`, then
        Timeout; None: the placement lock's own timeout); the route and the ms it took.

        One placement per capability at a time: in this process, the calls that find one
        under way await it; across processes, the placement lock decides, and a call that
        finds it held watches the route in Redis until it is served or the lock is let go. A
        placement runs in the pool, within its caller's share of placements; nothing else
        holds a thread while it waits."""
        from capabilities.services.placement import PlacementUnderWay, placement_lock_key

        started = time.perf_counter()
        waited = wait_seconds or self.placement_lock_seconds
        deadline = started + waited
        pause = PLACEMENT_POLL_FIRST_SECONDS
        while True:
            try:
                placing = self.placing.get(full)
                locked = placing is None and await self.redis.exists(placement_lock_key(full))
                # Calls that arrive together all ask Redis before any starts the placement: the
                # first answered starts it, the others await it (and take no placement share).
                placing = self.placing.get(full)
                if placing is None and not locked:
                    with self.shares.placement(principal):
                        placing = self.placing[full] = asyncio.ensure_future(self.place(full))
                        try:
                            route = await asyncio.wait_for(asyncio.shield(placing), deadline - time.perf_counter())
                        finally:
                            if self.placing.get(full) is placing:
                                del self.placing[full]
                    return route, (time.perf_counter() - started) * 1000
                if placing is not None:
                    route = await asyncio.wait_for(asyncio.shield(placing), deadline - time.perf_counter())
                    return route, (time.perf_counter() - started) * 1000
            except PlacementUnderWay:
                pass  # another process holds the lock: watch for what its placement makes
            except TimeoutError:
                raise Timeout(f"{full} is still being placed after {waited:g} s; try again shortly") from None
            while True:
                if time.perf_counter() + pause > deadline:
                    raise Timeout(f"{full} is still being placed after {waited:g} s; try again shortly")
                await asyncio.sleep(pause)
                pause = min(pause * 2, PLACEMENT_POLL_MAX_SECONDS)
                raw, locked = await self.redis.mget((routes.key(full), placement_lock_key(full)))
                route = routes.decode(raw) if raw is not None else None
                if route is not None and route.state in routes.SERVED_STATES:
                    return route, (time.perf_counter() - started) * 1000
                if raw == routes.TOMBSTONE:
                    raise NotFound(f"no capability {full}")
                if locked is None:
                    break  # the placement ended without serving it: try it here

    async def place(self, full: str) -> routes.CachedRoute:
        from capabilities.services.placement import capability_page_in

        route, _ = await self.offload(capability_page_in, full=full, wait_seconds=0)
        return route

    async def send_once(self, request: CallRequest, call: Call, route: routes.CachedRoute) -> UpstreamResponse:
        call.sent_at = sent_at = time.time()
        try:
            return await self.send(request, await self.target(route))
        except UpstreamTimeout as exc:
            error = Timeout(f"{call.full} did not answer within {self.upstream.read_timeout:g} s")
            await self.finish(call, status=error.status, code=error.code, message=error.message)
            raise error from exc
        except UpstreamUnreachable as exc:
            stopped = runtime_for(route.backend).call_stopped(slot=route.slot, tenant=route.agent, sent_at=sent_at)
            if stopped is None:
                raise self.runtime_failed(route, f"the runtime could not be reached for {call.full}: {exc}") from exc
            if not stopped.culprit:
                # Its process exited, or it shared one with a call that ran past a limit, or found
                # it restarting: not this capability's failure, so its breaker is left alone.
                whose = "its runtime process" if stopped.reason == "exited" else "another call in its runtime process"
                raise Unavailable(
                    f"{call.full} was interrupted: {whose} {stopped.message}; a fresh process is starting",
                    retry_after=1,
                ) from exc
            error = stopped_at_limit(call.full, stopped.message, cpu=stopped.reason == "cpu")
            await self.finish(call, status=error.status, code=error.code, message=error.message)
            raise error from exc

    def runtime_failed(self, route: routes.CachedRoute, message: str) -> UpstreamError:
        """The 502 for a runtime that failed a call; a capability still placed on the runtime
        used before SIGIL_BACKEND changed is told how it is moved."""
        if route.backend and route.backend != self.runtime.name:
            message += (
                f" (it is still placed on the {route.backend} runtime, not {self.runtime.name}: "
                "the owner moves it with `python manage.py switchbackend`)"
            )
        return UpstreamError(message)

    async def target(self, route: routes.CachedRoute) -> Route:
        """Where the route's slot answers, resolved once per placement: the route's own
        runtime (while `switchbackend` moves capabilities, some are still placed on the
        previous one, and are served there until their move is recorded)."""
        key = (route.backend, route.slot, route.sha, route.cpu_ms)
        target = self.route_memo.get(key)
        if target is None:
            runtime = runtime_for(route.backend)
            try:
                # No I/O but on a runtime's first call (Cloudflare's account subdomain).
                target = await self.offload(
                    runtime.route, slot=route.slot, sha=route.sha, tenant=route.agent, cpu_ms=route.cpu_ms
                )
            except RuntimeThrottled as exc:  # Cloudflare's lockout, while asked for the account's subdomain
                from capabilities.services.placement import runtime_throttled

                raise runtime_throttled(exc, doing=f"reach {route.slot}") from exc
            except RuntimeUnavailable as exc:
                raise self.runtime_failed(
                    route, f"the runtime could not say where slot {route.slot} answers: {exc}"
                ) from exc
            if len(self.route_memo) > 10_000:
                self.route_memo.clear()
            self.route_memo[key] = target
        return target

    def upstream_request(self, request: CallRequest, target: Route) -> tuple[str, dict[str, str]]:
        """The URL and headers of the call as the runtime gets it."""
        headers = forwarded_headers(request)
        headers["x-request-id"] = request.request_id  # Sigil's, never the caller's
        headers.update(target.headers)
        if target.host_header:
            headers["host"] = target.host_header
        # Normalised as a client library would: dot segments resolved, characters that may
        # not appear in a request line percent-encoded.
        url = target.base_url + request.rest + ("?" + request.query if request.query else "")
        parsed = parse_url(url)
        return f"{parsed.scheme}://{parsed.netloc}{parsed.request_uri}", headers

    async def send(self, request: CallRequest, target: Route) -> UpstreamResponse:
        url, headers = self.upstream_request(request, target)
        body: AsyncIterator[bytes] | bytes | None = None
        if request.length:
            headers["content-length"] = str(request.length)
            body = request.body
        elif request.chunked:
            body = _limited(request.body, self.max_body)
        return await self.upstream.request(request.method, url, headers=headers, body=body)

    async def finish(
        self, call: Call, *, status: int, ok: bool | None = None, code: str | None = None, message: str = ""
    ) -> None:
        """Record a call that reached the capability, answered `status` (ok unless 5xx, or
        as given), in one Redis round trip (stats.CallRecord); persist a breaker transition
        through Celery; give back the call's shares."""
        call.finished = True
        call.recorded = True
        self.give_shares(call)
        ok = status < 500 if ok is None else ok
        now = time.time()
        latency_ms = (time.perf_counter() - call.started) * 1000
        record = stats.CallRecord(
            full=call.full,
            capability_type=call.capability_type,
            token_hash=call.token_hash,
            at_epoch=now,
            latency_ms=latency_ms,
            status=status,
            ok=ok,
            is_trial=call.is_trial,
            inflight_process=call.inflight_process,
            page_in_ms=call.page_in_ms,
            code=code,
            failure=""
            if ok
            else failures.failure_encode(
                status=status,
                code=code,
                message=message,
                duration_ms=latency_ms,
                request_id=call.request_id,
                version=call.version,
                at_epoch=now,
            ),
        )
        change = await self.record_script(
            keys=record.keys(),
            args=record.args(
                rules=self.breaker, failures_kept=self.failures_kept, access_log_length=self.access_log_length
            ),
        )
        if change:
            await self.offload(breaker_changed, full=call.full, change=change, at_epoch=now)

    def give_shares(self, call: Call) -> None:
        if call.holds_call_share:
            call.holds_call_share = False
            self.shares.give_call(call.caller)
        if call.body_size:
            self.shares.give_body(call.owner, call.body_size)
            call.body_size = 0

    async def count_answer(self, full: str | None, status: int, code: str | None) -> None:
        """Count an answer that was no call to the capability's code (see stats.answer_count)."""
        try:
            pipe = self.redis.pipeline(transaction=True)
            stats.answer_count_queue(pipe, full=full, status=status, code=code)
            await pipe.execute()
        except REDIS_UNREACHABLE as exc:
            # The caller has its answer (likely `503 unavailable` for this same reason).
            logger.warning("Redis unreachable: a %s answer was not counted: %s", status, exc)

    async def abandon(self, call: Call) -> None:
        """A call that ended before the capability answered: give back what it holds."""
        call.finished = True
        self.give_shares(call)
        if not (call.is_trial or call.inflight_process):
            return
        pipe = self.redis.pipeline(transaction=False)
        if call.is_trial:
            pipe.delete(breaker.trial_key(call.full))
        if call.inflight_process:
            pager.pager_inflight_leave(call.full, process=call.inflight_process, pipe=pipe)
        try:
            await pipe.execute()
        except REDIS_UNREACHABLE as exc:
            logger.error("Redis unreachable: the call to %s left its counts: %s", call.full, exc)

    async def runtime_failure(self, upstream: UpstreamResponse, failure: str, call: Call) -> CallAnswer:
        message = (await upstream.read()).decode(errors="replace")[:2000]
        upstream.release()
        if failure == "exception":
            thrown = _exception_text(message)
            error: SigilError = CapabilityError(f"{call.full} threw: {thrown}")
            await self.finish(call, status=error.status, code=error.code, message=thrown)
        elif failure in (EXCEEDED_CPU, EXCEEDED_LIMITS):
            # The capability's own doing: it counts toward its breaker, and no other's. Worded
            # and classed as the local runtime's stops are: 504 for CPU, else 502.
            if failure == EXCEEDED_CPU:
                error = stopped_at_limit(call.full, _runtime_message(message, "ran past its CPU limit"), cpu=True)
            else:
                error = stopped_at_limit(call.full, "ran past its resource limits (CPU time or memory)", cpu=False)
            await self.finish(call, status=error.status, code=error.code, message=error.message)
        else:
            logger.error("runtime refused a call to %s: %s %s", call.full, failure, message)
            error = UpstreamError(f"the runtime failed to run {call.full} ({failure})")
        raise error  # answered by call(), which logs and counts it with its code

    def reply_redirect(self, call: Call, target: Route, request: CallRequest, page_in_ms) -> CallAnswer:
        """SIGIL_POOL_REDIRECT: send the caller to the script's own URL (the seed's 302)."""
        call.page_in_ms = page_in_ms
        location = target.base_url + request.rest + ("?" + request.query if request.query else "")
        headers = [("Location", location), ("Content-Length", "0"), ("X-Sigil-Capability", call.shown), NOSNIFF]
        if page_in_ms is not None:
            headers.append(("X-Sigil-Cold-Start", "1"))
        call.finished = True

        async def recorded(complete: bool) -> None:
            await self.finish(call, status=302)
            log_access(request, 302, call.started, capability=call.full, page_in_ms=page_in_ms)

        return CallAnswer(302, "Found", headers, b"", on_close=recorded)

    async def accept(self, request, served: Served, full: str, principal: Principal, token_hash: str, route_raw):
        """`Prefer: respond-async`: keep the call for the runners, answer 202 with where its
        result will be (capabilities/services/async_calls.py)."""
        from capabilities.services.async_calls import async_call_accept

        await self.visible_route(served, full, principal.agent_name, route_raw)  # refuse now what nobody could serve
        headers = forwarded_headers(request)
        callback_url = headers.pop("x-callback-url", None)
        headers.pop("prefer", None)  # both were addressed to Sigil
        if request.length and request.length > self.async_max_body:
            raise TooLarge(f"the request body of an asynchronous call is over {self.async_max_body} bytes")
        body = await read_body(request, self.async_max_body) if request.has_body else b""
        if request.length and len(body) < request.length:
            raise InvalidRequest("the request body ended before its Content-Length")
        accepted = await self.offload(
            async_call_accept,
            caller=principal.agent_name,
            full=full,
            token_hash=token_hash,
            method=request.method,
            rest=request.rest,
            query=request.query,
            headers=headers,
            body=body,
            callback_url=callback_url,
            request_id=request.request_id,
        )
        document = json.dumps(
            {
                "status": "accepted",
                "callback": accepted.status_url,
                "eta_seconds": accepted.eta_seconds,
                "call": accepted.call_id,
                "capability": full,
                "status_url": accepted.status_url,
            }
        ).encode()
        headers_out = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(document))),
            ("Location", accepted.status_url),
            ("Preference-Applied", "respond-async"),
            NOSNIFF,
        ]
        return CallAnswer(202, "Accepted", headers_out, document)

    async def open_websocket(self, request, call: Call, route, target: Route, page_in_ms) -> CallAnswer:
        """Ask the capability to take the caller's WebSocket; the answer carries the runtime's
        side of it for the adapter to relay (capabilities/engine/websocket.py)."""
        from capabilities.engine.websocket import websocket_open

        call.page_in_ms = page_in_ms
        return await websocket_open(self, request, call, route, target)


class AnswerBody:
    """Streams the capability's body to the caller; records the call once it has been sent."""

    def __init__(self, engine: Engine, upstream: UpstreamResponse, call: Call, route, request: CallRequest) -> None:
        self.engine = engine
        self.upstream = upstream
        self.call = call
        self.route = route
        self.request = request
        self.ok = upstream.status < 500
        self.counts = True
        self.message = ""  # for a failure record: the start of a 5xx body, or why it was cut
        self.cache_target: str | None = None
        self.cache_answer: degraded_cache.CachedAnswer | None = None
        self.cache_chunks: list[bytes] = []
        self.cache_complete = False  # the whole body was read (not cut)

    def keep_for_cache(self, target: str, answer: degraded_cache.CachedAnswer) -> None:
        """Keep the body as it streams, to store it as the last good answer to `target`
        (capabilities that opted in: degraded_cache)."""
        self.cache_target, self.cache_answer = target, answer

    async def stream(self) -> AsyncIterator[bytes]:
        room = self.engine.degraded_cache.max_body_bytes
        try:
            async for chunk in self.upstream.stream():
                if not self.ok and not self.message:
                    self.message = _first_line(chunk)
                if self.cache_answer is not None:
                    room -= len(chunk)
                    if room < 0:
                        self.cache_answer = None  # too large to keep: the call is not cached
                    else:
                        self.cache_chunks.append(chunk)
                yield chunk
            self.cache_complete = True
        except (UpstreamTimeout, UpstreamUnreachable) as exc:
            self.ok = False  # the capability stalled or broke mid-body; the caller sees a cut response
            self.message = f"failed while streaming its response: {exc}"
            logger.warning("%s failed while streaming its response: %s", self.call.full, exc)
            if isinstance(exc, UpstreamUnreachable):
                runtime = runtime_for(self.route.backend)
                stopped = runtime.call_stopped(slot=self.route.slot, tenant=self.route.agent, sent_at=self.call.sent_at)
                # Cut because another call ran its process past a limit: not this one's failure.
                # Nor is a memory stop that came while this call was only sending its answer: the
                # process cannot say which call grew it, and one that had answered is the least
                # likely (its own growth would have stopped it before its answer began).
                self.counts = stopped is None or (stopped.culprit and stopped.reason != "memory")

    async def close(self, complete: bool) -> None:
        """Called once the caller has the last byte (or went away), so this bookkeeping is off
        the caller's latency."""
        engine, call = self.engine, self.call
        self.upstream.release()
        try:
            if self.counts:
                await engine.finish(call, status=self.upstream.status, ok=self.ok, message=self.message)
            else:
                await engine.abandon(call)
            if self.cache_answer is not None and self.cache_complete and complete and self.ok:
                answer = replace(self.cache_answer, body=b"".join(self.cache_chunks), stored_epoch=time.time())
                await engine.offload(
                    engine.degraded_cache.store, get_redis(), full=call.full, target=self.cache_target, answer=answer
                )
        except REDIS_UNREACHABLE as exc:
            # The caller has its answer; only this call's counters and breaker update are lost.
            logger.error("Redis unreachable: the call to %s was not recorded: %s", call.full, exc)
        finally:
            log_access(
                self.request, self.upstream.status, call.started, capability=call.full, page_in_ms=call.page_in_ms
            )


def error_answer(error: SigilError) -> CallAnswer:
    body = error_body(error)
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))), NOSNIFF]
    headers.extend(error_headers(error).items())
    return CallAnswer(error.status, STATUS_TEXT.get(error.status, ""), headers, body, code=error.code)


def cached_reply(cached: degraded_cache.CachedAnswer, now: float) -> CallAnswer:
    headers = [*cached.headers, ("Content-Length", str(len(cached.body)))]
    headers += [degraded_cache.CACHE_HEADER, ("Age", str(int(max(0.0, now - cached.stored_epoch))))]
    return CallAnswer(cached.status, cached.reason, headers, cached.body)


STATUS_TEXT = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    409: "Conflict",
    413: "Content Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def log_access(
    request: CallRequest,
    status: int,
    started: float,
    *,
    capability: str | None,
    page_in_ms: float | None,
    code: str | None = None,
) -> None:
    """One line per call (logger `sigil.access`), its fields as the log's own (sigil/logs.py:
    JSON or text, with the time, process and request id), and for an answer Sigil wrote as an
    error, its error code."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    ms = round((time.perf_counter() - started) * 1000, 3)
    path = f"/{request.agent}/{request.name}{request.rest if request.rest != '/' else ''}"
    access_logger.info(
        "%s %s %d",
        request.method,
        path,
        status,
        extra={
            "method": request.method,
            "path": path,
            "capability": capability,
            "status": status,
            "code": code,
            "cold": page_in_ms is not None,
            "page_in_ms": None if page_in_ms is None else round(page_in_ms, 3),
            "ms": ms,
        },
    )


def forwarded_headers(request: CallRequest) -> dict[str, str]:
    """The caller's headers the capability gets: not its credentials, nor hop-by-hop fields,
    nor anything posing as Sigil's own (x-sigil-*)."""
    return {
        name: value
        for name, value in request.headers.items()
        if name not in DROPPED_REQUEST_HEADERS and not name.startswith("x-sigil-")
    }


def cache_target(rest: str, query: str | None) -> str:
    """What a degraded capability's cached answers are kept under: the path and query."""
    return rest + ("?" + query if query else "")


async def read_body(request: CallRequest, limit: int) -> bytes:
    """The whole request body, at most `limit` bytes. Raises TooLarge."""
    if isinstance(request.body, bytes):
        if len(request.body) > limit:
            raise TooLarge(f"the request body is over {limit} bytes")
        return request.body
    chunks, size = [], 0
    async for chunk in request.body:
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _limited(body: AsyncIterator[bytes] | bytes, limit: int) -> AsyncIterator[bytes]:
    """A chunked body passed on as it arrives, cut with TooLarge past `limit`."""
    if isinstance(body, bytes):
        body = _once(body)
    size = 0
    async for chunk in body:
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body is over {limit} bytes")
        yield chunk


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _prefers_async(request: CallRequest) -> bool:
    return not request.websocket and "respond-async" in request.headers.get("prefer", "")


def _unexpected(request: CallRequest, exc: Exception) -> SigilError:
    """The contract's answer to `exc`, logged once here with the request id the caller sees."""
    error = error_for_unexpected(exc, request_id=request.request_id)
    path = f"/{request.agent}/{request.name}"
    if isinstance(error, InternalError):
        logger.error("request %s failed: %s %s", error.request_id, request.method, path, exc_info=exc)
    else:
        logger.warning("%s %s answered %s: %s", request.method, path, error.code, exc)
    return error


def stopped_at_limit(full: str, what: str, *, cpu: bool) -> SigilError:
    """The answer to a call its runtime stopped at a limit, alike on every runtime: 504 for
    CPU time, 502 otherwise (memory, or a limit Cloudflare does not name)."""
    message = f"{full} {what} and was stopped"
    return Timeout(message) if cpu else CapabilityError(message)


def _runtime_message(body: str, fallback: str) -> str:
    """The message of a refusal of Sigil's own Worker (`{"error": …, "message": …}`)."""
    try:
        message = json.loads(body)["message"]
    except (ValueError, KeyError, TypeError):
        return fallback
    return message[:200] if isinstance(message, str) else fallback


def _first_line(chunk: bytes) -> str:
    lines = chunk[: failures.MESSAGE_MAX_CHARS].decode(errors="replace").strip().splitlines()
    return lines[0] if lines else ""


def _exception_text(host_message: str) -> str:
    try:
        return json.loads(host_message)["message"].splitlines()[0][:500]
    except (ValueError, KeyError, IndexError, TypeError):
        return host_message[:500]
