"""The call path: a CallRequest to the capability's code, and its CallAnswer, on an event loop.

A call holds no thread while it waits: on its capability, on a page-in, on another process's
placement lock, on Cloudflare. On a warm call it does no SQL and two Redis round trips: one
MGET before (the token, the route, the breaker and the caller's failed-token count:
admission.call_keys()), and after its answer was sent, its share of one script call that
records it with the calls that ended about when it did (recording: stats.CallRecord).
An answer the capability's code did not give (a refusal: 401, 404, 429, 503 degraded, ...) is
counted in one more round trip. What blocks by nature (the ORM on the cold path, a placement,
the Cloudflare client, a Celery enqueue) runs in a bounded pool of threads (offload), never on
the loop.

Every answer carries `X-Request-Id`, the id that names it in the access log, the failure
record and any logged traceback; the capability receives it as the same header.

Each agent gets a fair share of the process (engine.shares): a call over its agent's cap on
calls in flight, placements under way or body bytes in flight is `429 rate_limited`, and the
other agents notice nothing.

The engine's jobs, each in its module: the call's admission (admission), a cold call's
page-in (placing), sending and what its failures mean (sending), recording however a call ends
(recording), the asynchronous calls' way in (async_entry), Sigil's own answers (answers) and
the access log line (access_log). This module runs a call through them, top to bottom.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import quote

import redis.asyncio as aioredis
from django.conf import settings

from agents.throttle import FailedAuthThrottle
from agents.tokens import Principal
from capabilities import names
from capabilities.books import breaker, degraded_cache, pager, routes
from capabilities.engine.access_log import log_access
from capabilities.engine.admission import Admission, Admitted
from capabilities.engine.answers import NOSNIFF, cache_target, cached_reply, call_headers, error_answer
from capabilities.engine.async_entry import AsyncEntry, prefers_async
from capabilities.engine.calls import Call, Served
from capabilities.engine.offload import Offload
from capabilities.engine.placing import Placer
from capabilities.engine.recording import AnswerBody, Recorder
from capabilities.engine.sending import EXCEEDED_LIMITS, INTERNAL_ERROR, Sender
from capabilities.engine.shares import FairShares
from capabilities.engine.upstream import HOP_BY_HOP, UpstreamClient
from capabilities.engine.values import CallAnswer, CallRequest
from capabilities.engine.websocket import websocket_open
from capabilities.runtimes import get_runtime, runtime_for
from capabilities.runtimes.base import SERVED_VERSION_HEADER, Route
from capabilities.services import capability_mark_missing
from capabilities.services.observability import breaker_enter
from sigil.errors import (
    REDIS_UNREACHABLE,
    Degraded,
    InternalError,
    InvalidRequest,
    NotFound,
    SigilError,
    TooLarge,
    error_for_unexpected,
)
from sigil.pipelined_redis import PipelinedRedis
from sigil.redis_client import SOCKET_TIMEOUT_SECONDS, get_redis

logger = logging.getLogger("capabilities.engine")


class Engine:
    """One per process (per event loop): the runtime, the Redis clients, the upstream pools,
    the fair shares and the pool for blocking work, and the parts that do each job of a call."""

    def __init__(self) -> None:
        self.redis = aioredis.Redis.from_url(
            settings.REDIS_URL,
            socket_timeout=SOCKET_TIMEOUT_SECONDS,
            socket_connect_timeout=SOCKET_TIMEOUT_SECONDS,
            health_check_interval=30,
        )
        self.warm_redis = PipelinedRedis(settings.REDIS_URL, timeout=SOCKET_TIMEOUT_SECONDS)
        self.runtime = get_runtime()
        self.max_body = settings.SIGIL_INVOKE_MAX_BODY_BYTES
        self.degraded_cache = degraded_cache.DegradedCache.from_settings()
        self.breaker = breaker.Breaker.from_settings()
        # The pager deletes a victim only once no call to it is in flight; unbounded
        # runtimes never page out, so they skip the counting.
        self.tracks_inflight = self.runtime.total_slots is not None
        self.upstream = UpstreamClient(connect_timeout=5.0, read_timeout=settings.SIGIL_INVOKE_TIMEOUT_SECONDS)
        self.auth_throttle = FailedAuthThrottle.from_settings()
        self.shares = FairShares.from_settings()
        self.offload = Offload(settings.SIGIL_ENGINE_SYNC_THREADS)
        self.admission = Admission(self.redis, self.warm_redis, self.offload, self.auth_throttle, self.degraded_cache)
        self.placer = Placer(self.redis, self.offload, self.shares)
        self.recorder = Recorder(
            self.redis, self.warm_redis, self.offload, self.shares, self.breaker, self.degraded_cache
        )
        self.sender = Sender(self.runtime, self.upstream, self.offload, self.recorder, self.max_body)
        self.async_entry = AsyncEntry(self.offload)

    async def aclose(self) -> None:
        await self.recorder.close()
        await self.upstream.close()
        await self.redis.aclose()
        await self.warm_redis.aclose()
        self.offload.shutdown()

    # The edge.

    async def call(self, request: CallRequest) -> CallAnswer:
        """The answer to `request`, in the contract whatever happens: a bug or an unreachable
        Redis still gets the envelope and its access-log line."""
        started = time.perf_counter()
        served = Served(started)
        code = None
        redis_down = False
        try:
            answer = await self.handle(request, served)
        except SigilError as error:
            code = error.code
            answer = error_answer(error)
        except asyncio.CancelledError:  # the caller or the runner gave up: give back what it holds
            if served.call is not None and not served.call.finished:
                await self.recorder.abandon(served.call)
            raise
        except Exception as exc:
            error = _unexpected(request, exc)
            code = error.code
            redis_down = isinstance(exc, REDIS_UNREACHABLE)
            answer = error_answer(error)
        call = served.call
        if call is not None and not call.finished:
            await self.recorder.abandon(call)
        answer.headers.append(("X-Request-Id", request.request_id))
        if answer.on_close is None:  # an answer of Sigil's own: counted and logged now
            # Counting needs the Redis that just failed: a hung one would hold the answer twice.
            if (call is None or not call.recorded) and not redis_down:
                await self.recorder.count_answer(served.capability, answer.status, code)
            log_access(request, answer.status, started, capability=served.capability, page_in_ms=None, code=code)
        return answer

    async def handle(self, request: CallRequest, served: Served) -> CallAnswer:
        try:
            names.validate_agent_name(request.agent)
            names.validate_capability_name(request.name, ephemeral=True)
        except InvalidRequest as exc:
            raise NotFound(f"no capability at {quote(f'/{request.agent}/{request.name}')}") from exc
        if request.length is not None and request.length < 0:
            raise InvalidRequest("Content-Length is not a number")
        admitted = await self.admission.admit(request, served, names.full_name(request.agent, request.name))
        if request.accepted_token_hash is None and prefers_async(request):
            return await self.async_entry.accept(admitted)
        return await self.serve(admitted)

    async def serve(self, admitted: Admitted) -> CallAnswer:
        """From the route on: a split's staged version, the breaker, the shares, then the call."""
        request, served, route, principal = admitted.request, admitted.served, admitted.route, admitted.principal
        full = admitted.full
        breaker_raw = admitted.breaker_raw
        if route.split is not None:
            chosen = await self.admission.split_variant(route.split, request, admitted.token_hash)
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
                cached = await self.admission.cached_answer(request, route, full, now)
                if cached is None:
                    raise
                return cached_reply(cached, now)
        call = served.call = Call(full, route.type, admitted.token_hash, served.started, request.request_id)
        call.is_trial = is_trial
        call.shown = admitted.full
        call.caller = principal.agent_name
        call.owner = route.agent
        self.shares.take_call(principal)
        call.holds_call_share = True
        return await self.forward(request, call, route, principal)

    async def forward(self, request: CallRequest, call: Call, route: routes.CachedRoute, principal: Principal):
        """The admitted call through its runtime: its capability placed when cold, the call
        sent (again after a miss), the runtime's answer read and relayed."""
        if route.state not in routes.SERVED_STATES:
            route, call.page_in_ms = await self.placer.page_in(
                call.full, principal, wait_seconds=self.placement_wait(request)
            )
        call.version = route.version
        target = await self.sender.target(route)
        if target.redirect:
            return self.reply_redirect(call, target, request)
        if request.length:
            self.hold_body(request, call)
        if self.tracks_inflight:
            await self.count_inflight(call)
        if request.websocket:  # the answer carries the runtime's side for the adapter to relay
            return await websocket_open(self.sender, request, call, target, runtime_for(route.backend))
        upstream_started = time.perf_counter()
        upstream = await self.sender.send_once(request, call, route)
        # Every runtime's "script gone" answer is a 404: other calls skip the check.
        if upstream.status == 404 and runtime_for(route.backend).is_missing(upstream) and not request.has_body:
            route, upstream, upstream_started = await self.send_after_miss(
                request, call, route, principal, upstream, upstream_started
            )
        upstream_ms = (time.perf_counter() - upstream_started) * 1000
        failure = self.read_answer(call, route, upstream)
        if failure is not None:
            await self.sender.runtime_failure(upstream, failure, call)
        return self.relay(request, call, route, upstream, upstream_ms)

    def placement_wait(self, request: CallRequest) -> float | None:
        """How long a call waits out a placement under way. An accepted asynchronous call has no
        caller waiting: it waits as long as the placement may take, not as long as a call may."""
        return None if request.accepted_token_hash is not None else self.upstream.read_timeout

    def hold_body(self, request: CallRequest, call: Call) -> None:
        """Count the call's body against its owner's share; TooLarge over the limit."""
        if request.length > self.max_body:
            raise TooLarge(f"the request body is over {self.max_body} bytes")
        self.shares.take_body(call.owner, request.length)
        call.body_size = request.length

    def count_inflight(self, call: Call):
        """Count the call as in flight to its capability, which the pager then does not delete;
        the round trip to await. Counted per process: a count of a process that died stops
        holding up the page-out."""
        pipe = self.redis.pipeline(transaction=False)
        call.inflight_process = pager.pager_inflight_enter_queue(pipe, call.full)
        return pipe.execute()

    async def send_after_miss(self, request, call: Call, route, principal: Principal, upstream, upstream_started):
        """A bodiless call the runtime answered "script gone", sent again: on a warm call the
        runtime lost a script Sigil thought live (a miss after all, or the route was out of
        date: a switch of runtime moved it), so it is paged in and sent once more; a call that
        just placed it is sent again while Cloudflare propagates it. (A body cannot be sent
        twice.) The route, the last answer and when its sending started."""
        if call.page_in_ms is None:
            await upstream.drain()
            upstream.release()
            self.sender.forget(route)
            await self.offload(capability_mark_missing, full=call.full, slot=route.slot, backend=route.backend)
            route, call.page_in_ms = await self.placer.page_in(
                call.full, principal, wait_seconds=self.placement_wait(request)
            )
            call.version = route.version
            upstream_started = time.perf_counter()
            upstream = await self.sender.send_once(request, call, route)
            if not (upstream.status == 404 and runtime_for(route.backend).is_missing(upstream)):
                return route, upstream, upstream_started
        upstream = await self.sender.resend_while_propagating(request, call, route, upstream)
        return route, upstream, upstream_started

    def read_answer(self, call: Call, route: routes.CachedRoute, upstream) -> str | None:
        """What the runtime's answer says of the call: the version that answered, and the
        runtime's failure, if it is one (sending's EXCEEDED_LIMITS, INTERNAL_ERROR or the
        failure Sigil's own code marked), else None."""
        # The placed code names its own version where the runtime replaces code in place
        # (worker-pool, platform): the header is then the truth, not the route's.
        served = upstream.headers.get(SERVED_VERSION_HEADER)
        if served is not None and served.isdigit():
            call.version = int(served)
        failure = upstream.headers.get("x-sigil-error")
        if failure is None and upstream.status >= 500:
            # An unmarked 5xx is the runtime's own: its stop at the capability's limits (1102),
            # or its own side failing; both are told apart by the runtime.
            runtime = runtime_for(route.backend)
            if runtime.stopped_at_limits(upstream):
                failure = EXCEEDED_LIMITS
            elif runtime.failed_itself(upstream):
                failure = INTERNAL_ERROR
        return failure

    def relay(self, request: CallRequest, call: Call, route: routes.CachedRoute, upstream, upstream_ms: float):
        """The capability's answer as the caller gets it: its headers less the hop-by-hop and
        Sigil's internal ones, plus Sigil's own, and its body streamed; its close records the
        call (and keeps a degraded capability's copy of it, when it opted in)."""
        headers = [
            (k, v)
            for k, v in upstream.header_pairs()
            if k.lower() not in HOP_BY_HOP and not k.lower().startswith("x-sigil-")
        ]
        headers.extend(call_headers(call, upstream_ms=upstream_ms))
        call.finished = True  # from here the answer's close() records the call
        body = AnswerBody(self.recorder, upstream, call, route, request)
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
        return CallAnswer(
            upstream.status,
            upstream.reason,
            headers,
            body.stream(),
            on_close=body.close,
            body_ended=upstream.ended,
            body_arrived=upstream.arrived,
        )

    def reply_redirect(self, call: Call, target: Route, request: CallRequest) -> CallAnswer:
        """SIGIL_POOL_REDIRECT: send the caller to the script's own URL (the seed's 302)."""
        page_in_ms = call.page_in_ms
        location = target.base_url + request.rest + ("?" + request.query if request.query else "")
        headers = [("Location", location), ("Content-Length", "0"), ("X-Sigil-Capability", call.shown), NOSNIFF]
        if page_in_ms is not None:
            headers.append(("X-Sigil-Cold-Start", "1"))
        call.finished = True

        async def recorded(complete: bool) -> None:
            await self.recorder.finish(call, status=302)
            log_access(request, 302, call.started, capability=call.full, page_in_ms=page_in_ms)

        return CallAnswer(302, "Found", headers, b"", on_close=recorded)


def _unexpected(request: CallRequest, exc: Exception) -> SigilError:
    """The contract's answer to `exc`, logged once here with the request id the caller sees."""
    error = error_for_unexpected(exc, request_id=request.request_id)
    path = f"/{request.agent}/{request.name}"
    if isinstance(error, InternalError):
        logger.error("request %s failed: %s %s", error.request_id, request.method, path, exc_info=exc)
    else:
        logger.warning("%s %s answered %s: %s", request.method, path, error.code, exc)
    return error
