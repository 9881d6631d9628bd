"""The invoke hot path: `ANY /{agent}/{capability}[/rest]` to the capability's code.

A plain WSGI application, mounted in front of Django by sigil_site/wsgi.py, so a call pays
for no middleware, URL resolver or request object. On a warm call it does no SQL: the
token, the route and the breaker come from Redis in one MGET, and the call's counters,
access stamp, breaker update and (for a failure) its failure record go back in one script
call after the response is sent. An answer the capability's code did not give (a refusal:
401, 404, 429, 503 degraded, ...) is counted in one more round trip.

Every answer carries `X-Request-Id`, the id that names it in the access log, the failure
record and any logged traceback; the capability receives it as the same header.

Two paths leave the warm one as soon as they are recognised, and cost it nothing more:
`Prefer: respond-async` (the call is kept and answered 202, then run from Celery through
this same code: ACCEPTED_CALLER), and a GET to a degraded capability that opted in to a
cached answer (degraded_cache; only such capabilities keep their answers).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import zlib
from urllib.parse import quote

import redis
from django.conf import settings
from django.db import close_old_connections, connection
from urllib3.util import parse_url

from agents import tokens
from agents.selectors import parse_bearer, token_authenticate_hash
from agents.throttle import FailedAuthThrottle
from capabilities import breaker, degraded_cache, failures, names, pager, routes, stats
from capabilities.runtimes import get_runtime, runtime_for
from capabilities.runtimes.base import Route
from capabilities.runtimes.errors import RuntimeUnavailable
from capabilities.upstream import (
    HOP_BY_HOP,
    UpstreamConnections,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from sigil_site.errors import (
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
from sigil_site.redis_client import get_redis
from sigil_site.request_id import current_request_id, new_request_id, set_request_id

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("sigil.access")

# What the gateway drops from the caller's request besides hop-by-hop fields: the caller's
# credentials, and (below) anything posing as Sigil's internal headers.
DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {"authorization"}
STREAM_CHUNK = 64 * 1024
# Cloudflare stopped the capability at its limits. Sigil's own Workers answer `exceeded-cpu`
# (with "ran past its CPU limit of N ms") when they see it; an unmarked 1102, which does not
# say whether CPU or memory ran out, is read as EXCEEDED_LIMITS (Runtime.stopped_at_limits).
EXCEEDED_CPU = "exceeded-cpu"
EXCEEDED_LIMITS = "exceeded-limits"
# On every answer the gateway writes itself (never on a capability's own responses, which
# pass through unchanged): a browser must not guess a type other than the one sent.
NOSNIFF = ("X-Content-Type-Options", "nosniff")
# The environ key under which an accepted asynchronous call is run again, from Celery, with
# the hash of the token that sent it (capabilities/services/async_calls.py). A client cannot
# set it: the server puts the caller's headers under HTTP_*.
ACCEPTED_CALLER = "sigil.accepted_caller"


# The values of call_keys(), already read by a caller in this process (MCP's tools/call reads
# them with its own), so that the call costs no second round trip. Only code can set an
# environ key without the HTTP_ prefix: no client can pass this.
PREFETCHED = "sigil.prefetched"


def call_keys(token_hash: str, full: str, throttle_key: str) -> tuple[str, str, str, str]:
    """What a call reads from Redis before it is forwarded, in one MGET: the token, the route,
    the breaker and the caller's failed-token count."""
    return tokens.cache_key(token_hash), routes.key(full), breaker.open_key(full), throttle_key


# How a call to a script it has just placed waits for Cloudflare to propagate it: the first
# pause, doubled after each "not found" up to the longest.
PROPAGATION_FIRST_PAUSE_SECONDS = 0.05
PROPAGATION_MAX_PAUSE_SECONDS = 1.0


class Call:
    """What one call holds while it is served, and must give back however it ends."""

    __slots__ = (
        "capability_type",
        "finished",
        "full",
        "holds_inflight",
        "is_trial",
        "page_in_ms",
        "recorded",
        "request_id",
        "sent_at",
        "shown",
        "started",
        "token_hash",
        "version",
    )

    def __init__(
        self, full: str, capability_type: str, token_hash: str, started: float, is_trial: bool, request_id: str
    ) -> None:
        self.full = full  # what is placed, counted and broken: a staged version's own name in a split
        self.shown = full  # the capability the caller called
        self.capability_type = capability_type
        self.token_hash = token_hash
        self.started = started
        self.is_trial = is_trial
        self.request_id = request_id
        self.holds_inflight = False
        self.finished = False
        self.recorded = False  # counted as a call (finish), not as a refusal
        self.page_in_ms: float | None = None
        self.sent_at = 0.0  # epoch the request left for the runtime
        self.version: int | None = None  # the version number of the code that answered


class Gateway:
    """One per process; holds the runtime, the Redis client and the upstream connection pools."""

    def __init__(self) -> None:
        self.redis = get_redis()
        self.runtime = get_runtime()
        self.record_call = self.redis.register_script(stats.RECORD_CALL)
        self.max_body = settings.SIGIL_INVOKE_MAX_BODY_BYTES
        self.failures_kept = settings.SIGIL_FAILURES_KEPT
        self.async_max_body = settings.SIGIL_ASYNC_MAX_BODY_BYTES
        self.degraded_cache = degraded_cache.DegradedCache.from_settings()
        self.access_log_length = settings.SIGIL_ACCESS_PATTERN_MAX_CALLS
        self.breaker = breaker.Breaker.from_settings()
        # The pager deletes a victim only once no call to it is in flight; unbounded
        # runtimes never page out, so they skip the counting.
        self.tracks_inflight = self.runtime.total_slots is not None
        self.upstream = UpstreamConnections(connect_timeout=5.0, read_timeout=settings.SIGIL_INVOKE_TIMEOUT_SECONDS)
        self.route_memo: dict[tuple, Route] = {}
        self.auth_throttle = FailedAuthThrottle.from_settings()
        self.local = threading.local()

    def __call__(self, environ, start_response):
        started = time.perf_counter()
        connection_was_open = _db_connection_open()
        # One id per answer: the one sigil_site/wsgi.py gave the request (an MCP tool call
        # shares its MCP request's), so the access line, the failure record and the header agree.
        request_id = environ.get(REQUEST_ID) or current_request_id()
        if request_id is None:
            request_id = new_request_id()
            set_request_id(request_id)
        environ[REQUEST_ID] = request_id
        sent = []

        def start_and_remember(status, headers, exc_info=None):
            sent.append(status)
            headers.append(("X-Request-Id", request_id))
            return start_response(status, headers, exc_info)

        code = None
        redis_down = False
        try:
            result = self.handle(environ, start_and_remember, started)
        except SigilError as error:
            code = error.code
            result = self.reply_error(start_and_remember, error)
        except Exception as exc:
            # The edge answers in the contract, always: a bug or an unreachable Redis still
            # gets the envelope and its access-log line, never the server's bare 500.
            if sent:
                raise  # the status line is out; the server can only cut the response
            error = _unexpected(environ, exc)
            code = error.code
            redis_down = isinstance(exc, REDIS_UNREACHABLE)
            result = self.reply_error(start_and_remember, error)
        try:
            if isinstance(result, ResponseBody):
                result.environ = environ  # logged when the body has been sent
            else:
                status = int(sent[0][:3])
                full = environ.get(CAPABILITY)
                call = environ.get(CALL)
                # Counting needs the Redis that just failed: a hung one would hold the answer twice.
                if (call is None or not call.recorded) and not redis_down:
                    self.count_answer(full, status, code)
                log_access(environ, status, started, capability=full, page_in_ms=None, code=code)
            return result
        finally:
            if _db_connection_open() != connection_was_open:
                # The cold path touched the database: end the connection's life as Django
                # does after a request (CONN_MAX_AGE), since no Django handler runs here.
                close_old_connections()

    def handle(self, environ, start_response, started: float):
        agent, name, rest = split_path(environ.get("PATH_INFO", ""))
        full = names.full_name(agent, name)
        accepted = environ.get(ACCEPTED_CALLER)
        if accepted is not None:
            # Run as the caller who sent it, if its token still stands (it may have been revoked since).
            token_hash = accepted
            keys = (tokens.cache_key(token_hash), routes.key(full), breaker.open_key(full))
            token_raw, route_raw, breaker_raw = self.thread_redis().mget(keys)
            principal = token_authenticate_hash(token_hash, cached=token_raw)
        else:
            authorization = environ.get("HTTP_AUTHORIZATION")
            if authorization is not None and SERVER_ENVIRONMENT_HEADERS.get("HTTP_AUTHORIZATION") == authorization:
                authorization = None  # the server's environment, not the caller's header
            secret = parse_bearer(authorization)
            token_hash = tokens.hash_secret(secret)
            address = self.auth_throttle.address(environ)
            if PREFETCHED in environ:
                token_raw, route_raw, breaker_raw, auth_failures = environ[PREFETCHED]
            else:
                keys = call_keys(token_hash, full, self.auth_throttle.key(address))
                try:
                    token_raw, route_raw, breaker_raw, auth_failures = self.thread_redis().mget(keys)
                except redis.ConnectionError:
                    # The held connection was closed (Redis restarted, or dropped an idle client);
                    # redis-py has discarded it, so this reconnects.
                    token_raw, route_raw, breaker_raw, auth_failures = self.thread_redis().mget(keys)
            if route_raw is not None and route_raw != routes.TOMBSTONE:
                environ[CAPABILITY] = full  # a refusal from here on is counted on the capability
            principal = self.auth_throttle.authenticate(
                self.redis, address, secret, cached=token_raw, failures=auth_failures
            )
            if _prefers_async(environ):
                return self.reply_accepted(environ, start_response, full, principal.agent_name, token_hash, route_raw)
        return self.serve(
            environ,
            start_response,
            started=started,
            full=full,
            rest=rest,
            caller=principal.agent_name,
            token_hash=token_hash,
            route_raw=route_raw,
            breaker_raw=breaker_raw,
        )

    def visible_route(self, environ, full: str, caller: str, route_raw: bytes | None) -> routes.CachedRoute:
        """The route of `full` as `caller` may see it; NotFound for another agent's private
        capability, an unknown or an expired one."""
        if route_raw is None:
            route_raw = routes.route_load(full)
        route = routes.decode(route_raw)
        if route is not None:
            environ[CAPABILITY] = full
        if not routes.route_visible(route, caller):
            raise NotFound(f"no capability {full}")
        if route.expires_epoch is not None and route.expires_epoch <= time.time():
            raise NotFound(f"{full} has expired")
        return route

    def serve(self, environ, start_response, *, started, full, rest, caller, token_hash, route_raw, breaker_raw):
        """From the route on: the breaker, the page-in when cold, the call and its record."""
        route = self.visible_route(environ, full, caller, route_raw)
        called = full
        if route.split is not None:
            chosen = self.split_variant(route.split, environ, token_hash)
            if chosen is not None:
                full, route, breaker_raw = chosen
        now = time.time()
        is_trial = False
        if breaker_raw is not None:  # not closed: open, half-open or forced
            try:
                is_trial = self.breaker.enter(self.redis, full=full, raw=breaker_raw, now=now)
            except Degraded:
                cached = self.cached_answer(environ, route, full, rest, now)
                if cached is None:
                    raise
                return self.reply_cached(start_response, cached, now)
        call = environ[CALL] = Call(full, route.type, token_hash, started, is_trial, environ[REQUEST_ID])
        call.shown = called
        try:
            return self.forward(environ, start_response, call, route, rest)
        finally:
            if not call.finished:
                self.abandon(call)

    def split_variant(self, split: routes.Split, environ, token_hash: str):
        """The staged version's name, route and breaker state when this caller's key falls in
        the split's share, else None. One hash of the key (the named header, else the token),
        salted with the version so each split draws its own callers; a call that goes there
        reads its route and breaker in one more MGET."""
        caller = environ.get(split.caller_environ) or token_hash
        if zlib.crc32(f"{split.variant}|{caller}".encode()) % 100 >= split.weight:
            return None
        route_raw, breaker_raw = self.thread_redis().mget((routes.key(split.variant), breaker.open_key(split.variant)))
        if route_raw is None:
            route_raw = routes.route_load(split.variant)
        route = routes.decode(route_raw)
        return None if route is None else (split.variant, route, breaker_raw)  # None: the split just ended

    def forward(self, environ, start_response, call: Call, route: routes.CachedRoute, rest: str):
        page_in_ms = None
        # An accepted asynchronous call has no caller waiting: it waits out a placement under
        # way as long as the placement may take, not as long as a call may.
        page_in_wait = None if ACCEPTED_CALLER in environ else self.upstream.read_timeout
        if route.state not in routes.SERVED_STATES:
            route, page_in_ms = self.page_in(call.full, wait_seconds=page_in_wait)
        call.version = route.version
        target = self.target(route)
        if target.redirect:
            return self.reply_redirect(start_response, call, target, rest, environ.get("QUERY_STRING"), page_in_ms)
        if self.tracks_inflight:
            self.redis.incr(pager.inflight_key(call.full))
            call.holds_inflight = True

        upstream_started = time.perf_counter()
        upstream = self.send_once(environ, call, route, rest)
        # Every runtime's "script gone" answer is a 404: other calls skip the check.
        missed = upstream.status == 404 and runtime_for(route.backend).is_missing(upstream)
        if page_in_ms is None and missed and not environ.get("CONTENT_LENGTH"):
            # The runtime lost a script Sigil thought live: a miss after all (or the route
            # was out of date: a switch of runtime moved it). Page it in and retry once
            # (only bodiless calls: a body cannot be sent twice).
            upstream.drain_conn()
            upstream.release_conn()
            from capabilities.services import capability_mark_missing

            capability_mark_missing(full=call.full, slot=route.slot, backend=route.backend)
            route, page_in_ms = self.page_in(call.full, wait_seconds=page_in_wait)
            call.version = route.version
            upstream_started = time.perf_counter()
            upstream = self.send_once(environ, call, route, rest)
            missed = upstream.status == 404 and runtime_for(route.backend).is_missing(upstream)
        if missed and page_in_ms is not None and not environ.get("CONTENT_LENGTH"):
            upstream = self.resend_while_propagating(environ, call, route, rest, upstream)
        upstream_ms = (time.perf_counter() - upstream_started) * 1000
        call.page_in_ms = page_in_ms

        failure = upstream.headers.get("x-sigil-error")
        if failure is None and upstream.status == 503 and runtime_for(route.backend).stopped_at_limits(upstream):
            failure = EXCEEDED_LIMITS
        if failure is not None:
            return self.reply_runtime_failure(start_response, upstream, failure, call)

        headers = [
            (k, v)
            for k, v in upstream.headers.items()
            if k.lower() not in HOP_BY_HOP and not k.lower().startswith("x-sigil-")
        ]
        sigil_ms = (time.perf_counter() - call.started) * 1000 - upstream_ms - (page_in_ms or 0)
        timing = f"sigil;dur={sigil_ms:.2f}, capability;dur={upstream_ms:.2f}"
        headers.append(("X-Sigil-Capability", call.shown))
        if route.version is not None:
            headers.append(("X-Sigil-Version", str(route.version)))
        if page_in_ms is not None:
            headers.append(("X-Sigil-Cold-Start", "1"))
            timing += f", page-in;dur={page_in_ms:.2f}"
        headers.append(("Server-Timing", timing))
        start_response(f"{upstream.status} {upstream.reason or ''}".rstrip(), headers)
        call.finished = True  # from here ResponseBody.close() records the call
        body = ResponseBody(self, upstream, call, route, ok=upstream.status < 500)
        if route.cache_when_degraded and environ["REQUEST_METHOD"] == "GET" and 200 <= upstream.status < 300:
            body.keep_for_cache(
                cache_target(rest, environ.get("QUERY_STRING")),
                degraded_cache.CachedAnswer(
                    status=upstream.status,
                    reason=upstream.reason or "",
                    headers=[(k, v) for k, v in headers if k.lower() not in ("content-length", "server-timing")],
                    body=b"",
                    stored_epoch=0.0,
                ),
            )
        return body

    def cached_answer(self, environ, route, full: str, rest: str, now: float):
        """The last good answer to this GET, for a degraded capability that opted in; else None."""
        if not route.cache_when_degraded or environ["REQUEST_METHOD"] != "GET":
            return None
        target = cache_target(rest, environ.get("QUERY_STRING"))
        return self.degraded_cache.lookup(self.redis, full=full, target=target, now=now)

    def reply_cached(self, start_response, cached: degraded_cache.CachedAnswer, now: float):
        headers = [*cached.headers, ("Content-Length", str(len(cached.body)))]
        headers += [degraded_cache.CACHE_HEADER, ("Age", str(int(max(0.0, now - cached.stored_epoch))))]
        start_response(f"{cached.status} {cached.reason}".rstrip(), headers)
        return [cached.body]

    def resend_while_propagating(
        self, environ, call: Call, route: routes.CachedRoute, rest: str, upstream: UpstreamResponse
    ) -> UpstreamResponse:
        """Send a bodiless call again while the script this call just placed (or Sigil's own
        Worker in front of it, deployed by that placement) still answers "not found": Cloudflare
        serves a new Worker, and a workers.dev route just turned on, only once they have
        propagated. Backs off, within the call's time (SIGIL_INVOKE_TIMEOUT_SECONDS); the last
        answer is the caller's. Nothing ran the capability's code meanwhile, so resending is safe."""
        runtime = runtime_for(route.backend)
        deadline = call.started + self.upstream.read_timeout
        pause = PROPAGATION_FIRST_PAUSE_SECONDS
        while time.perf_counter() + pause < deadline:
            upstream.drain_conn()
            upstream.release_conn()
            time.sleep(pause)
            pause = min(pause * 2, PROPAGATION_MAX_PAUSE_SECONDS)
            upstream = self.send_once(environ, call, route, rest)
            if not (upstream.status == 404 and runtime.is_missing(upstream)):
                break
        return upstream

    def thread_redis(self) -> redis.Redis:
        """A client holding one connection for this server thread, for the two commands every
        call sends: taking a connection from the shared pool costs three system calls per
        command, and each lets another thread take the GIL."""
        client = getattr(self.local, "redis", None)
        if client is None:
            client = redis.Redis(connection_pool=self.redis.connection_pool, single_connection_client=True)
            self.local.redis = client
        return client

    def page_in(self, full: str, *, wait_seconds: float | None) -> tuple[routes.CachedRoute, float]:
        """Place `full` (or wait for the placement under way, at most `wait_seconds`: then
        Timeout; None: the placement lock's own timeout); the route and the ms it took."""
        from capabilities.services import capability_page_in

        started = time.perf_counter()
        route, _ = capability_page_in(full=full, wait_seconds=wait_seconds)
        return route, (time.perf_counter() - started) * 1000

    def send_once(self, environ, call: Call, route: routes.CachedRoute, rest: str) -> UpstreamResponse:
        call.sent_at = sent_at = time.time()
        try:
            return self.send(environ, self.target(route), rest)
        except UpstreamTimeout as exc:
            error = Timeout(f"{call.full} did not answer within {self.upstream.read_timeout:g} s")
            self.finish(call, status=error.status, code=error.code, message=error.message)
            raise error from exc
        except UpstreamUnreachable as exc:
            stopped = runtime_for(route.backend).call_stopped(slot=route.slot, sent_at=sent_at)
            if stopped is None:
                raise self.runtime_failed(route, f"the runtime could not be reached for {call.full}: {exc}") from exc
            if not stopped.culprit:
                # It shared a process with a call that ran past a limit, or found it restarting:
                # not this capability's failure, so its breaker is left alone.
                raise Unavailable(
                    f"{call.full} was interrupted: another call in its runtime process {stopped.message}; "
                    "a fresh process is starting",
                    retry_after=1,
                ) from exc
            error = stopped_at_limit(call.full, stopped.message, cpu=stopped.reason == "cpu")
            self.finish(call, status=error.status, code=error.code, message=error.message)
            raise error from exc

    def runtime_failed(self, route: routes.CachedRoute, message: str) -> UpstreamError:
        """The 502 for a runtime that failed a call; a capability still placed on the runtime
        used before SIGIL_BACKEND changed is told how it is moved."""
        if route.backend != self.runtime.name:
            message += (
                f" (it is still placed on the {route.backend} runtime, not {self.runtime.name}: "
                "the owner moves it with `python manage.py switchbackend`)"
            )
        return UpstreamError(message)

    def target(self, route: routes.CachedRoute) -> Route:
        # The route's own runtime: while `switchbackend` moves capabilities, some are still
        # placed on the previous one, and are served there until their move is recorded.
        key = (route.backend, route.slot, route.sha, route.cpu_ms)
        target = self.route_memo.get(key)
        if target is None:
            try:
                target = runtime_for(route.backend).route(slot=route.slot, sha=route.sha, cpu_ms=route.cpu_ms)
            except RuntimeUnavailable as exc:  # e.g. Cloudflare failing when asked for the account's subdomain
                raise self.runtime_failed(
                    route, f"the runtime could not say where slot {route.slot} answers: {exc}"
                ) from exc
            if len(self.route_memo) > 10_000:
                self.route_memo.clear()
            self.route_memo[key] = target
        return target

    def send(self, environ, target: Route, rest: str) -> UpstreamResponse:
        headers = request_headers(environ)
        headers["x-request-id"] = environ[REQUEST_ID]  # Sigil's, never the caller's
        headers.update(target.headers)
        if target.host_header:
            headers["host"] = target.host_header  # request_headers() keys are lower case
        query = environ.get("QUERY_STRING")
        # Normalised as a client library would: dot segments resolved, characters that may
        # not appear in a request line percent-encoded.
        request_target = parse_url(target.base_url + rest + ("?" + query if query else "")).request_uri
        body, size = None, None
        length = environ.get("CONTENT_LENGTH")
        if length:
            try:
                size = int(length)
            except ValueError as exc:
                raise InvalidRequest("Content-Length is not a number") from exc
            if size > self.max_body:
                raise TooLarge(f"the request body is over {self.max_body} bytes")
            if size:
                body = environ["wsgi.input"]
                headers["Content-Length"] = length
        elif environ.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked":
            body = read_limited(environ["wsgi.input"], self.max_body)
            # Read whole, it is a body of known length from here on: never retried as a
            # bodiless call (the stream cannot be read twice).
            environ["CONTENT_LENGTH"] = str(len(body))
        return self.upstream.request(
            environ["REQUEST_METHOD"], target.base_url, request_target, headers=headers, body=body, size=size
        )

    def finish(
        self, call: Call, *, status: int, ok: bool | None = None, code: str | None = None, message: str = ""
    ) -> None:
        """Record a call that reached the capability, answered `status` (ok unless 5xx, or
        as given), in one Redis round trip: its counters, and for a failure its failure
        record with Sigil's error `code` and the capability's own `message`; persist a
        breaker transition through Celery."""
        call.finished = True
        call.recorded = True
        ok = status < 500 if ok is None else ok
        now = time.time()
        latency_ms = (time.perf_counter() - call.started) * 1000
        record = ""
        if not ok:
            record = failures.failure_encode(
                status=status,
                code=code,
                message=message,
                duration_ms=latency_ms,
                request_id=call.request_id,
                version=call.version,
                at_epoch=now,
            )
        change = self.record_call(
            client=self.thread_redis(),
            keys=[
                stats.stats_key(call.full),
                breaker.failures_key(call.full),
                breaker.open_key(call.full),
                breaker.trial_key(call.full),
                stats.DIRTY_KEY,
                stats.TOKENS_USED_KEY,
                pager.lru_key(call.capability_type),
                pager.inflight_key(call.full),
                failures.failures_key(call.full),
                stats.ACCESS_LOG_KEY,
            ],
            args=[
                call.full,
                call.token_hash,
                f"{now:.6f}",
                f"{latency_ms:.3f}",
                int(ok),
                int(call.is_trial),
                self.breaker.threshold,
                self.breaker.cooldown_seconds,
                int(call.holds_inflight),
                stats.bucket_field(latency_ms),
                "" if call.page_in_ms is None else f"{call.page_in_ms:.3f}",
                stats.status_field(status),
                stats.code_field(code),
                record,
                self.failures_kept,
                call.capability_type,
                self.access_log_length,
            ],
        )
        breaker.breaker_changed(full=call.full, change=change, at_epoch=now)

    def count_answer(self, full: str | None, status: int, code: str | None) -> None:
        """Count an answer that was no call to the capability's code (see stats.answer_count)."""
        try:
            stats.answer_count(full=full, status=status, code=code)
        except REDIS_UNREACHABLE as exc:
            # The caller has its answer (likely `503 unavailable` for this same reason).
            logger.warning("Redis unreachable: a %s answer was not counted: %s", status, exc)

    def abandon(self, call: Call) -> None:
        """A call that ended before the capability answered: give back what it holds."""
        call.finished = True
        if not (call.is_trial or call.holds_inflight):
            return
        pipe = self.redis.pipeline(transaction=False)
        if call.is_trial:
            pipe.delete(breaker.trial_key(call.full))
        if call.holds_inflight:
            pipe.decr(pager.inflight_key(call.full))
        pipe.execute()

    def reply_runtime_failure(self, start_response, upstream, failure: str, call: Call):
        message = upstream.data.decode(errors="replace")[:2000]
        upstream.release_conn()
        if failure == "exception":
            thrown = _exception_text(message)
            error: SigilError = CapabilityError(f"{call.full} threw: {thrown}")
            self.finish(call, status=error.status, code=error.code, message=thrown)
        elif failure in (EXCEEDED_CPU, EXCEEDED_LIMITS):
            # The capability's own doing: it counts toward its breaker, and no other's. Worded
            # and classed as the local runtime's stops are: 504 for CPU, else 502.
            if failure == EXCEEDED_CPU:
                error = stopped_at_limit(call.full, _runtime_message(message, "ran past its CPU limit"), cpu=True)
            else:
                error = stopped_at_limit(call.full, "ran past its resource limits (CPU time or memory)", cpu=False)
            self.finish(call, status=error.status, code=error.code, message=error.message)
        else:
            logger.error("runtime refused a call to %s: %s %s", call.full, failure, message)
            error = UpstreamError(f"the runtime failed to run {call.full} ({failure})")
        raise error  # answered by __call__, which logs and counts it with its code

    def reply_redirect(self, start_response, call: Call, target: Route, rest: str, query: str | None, page_in_ms):
        """SIGIL_POOL_REDIRECT: send the caller to the script's own URL (the seed's 302)."""
        call.page_in_ms = page_in_ms
        self.finish(call, status=302)
        location = target.base_url + rest + ("?" + query if query else "")
        headers = [("Location", location), ("Content-Length", "0"), ("X-Sigil-Capability", call.shown), NOSNIFF]
        if page_in_ms is not None:
            headers.append(("X-Sigil-Cold-Start", "1"))
        start_response("302 Found", headers)
        return [b""]

    def reply_accepted(self, environ, start_response, full: str, caller: str, token_hash: str, route_raw):
        """`Prefer: respond-async`: keep the call, run it in Celery, answer 202 with where its
        result will be (capabilities/services/async_calls.py)."""
        from capabilities.services.async_calls import async_call_accept

        self.visible_route(environ, full, caller, route_raw)  # a call nobody could serve is refused now
        headers = request_headers(environ)
        callback_url = headers.pop("x-callback-url", None)
        headers.pop("prefer", None)  # both were addressed to Sigil
        length = environ.get("CONTENT_LENGTH")
        if length and not length.isdigit():
            raise InvalidRequest("Content-Length is not a number")
        if length and int(length) > self.async_max_body:
            raise TooLarge(f"the request body of an asynchronous call is over {self.async_max_body} bytes")
        chunked = environ.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked"
        body = read_limited(environ["wsgi.input"], self.async_max_body) if length or chunked else b""
        if length and len(body) < int(length):
            raise InvalidRequest("the request body ended before its Content-Length")
        accepted = async_call_accept(
            caller=caller,
            full=full,
            token_hash=token_hash,
            method=environ["REQUEST_METHOD"],
            path=environ.get("PATH_INFO", ""),
            query=environ.get("QUERY_STRING", ""),
            headers=headers,
            body=body,
            callback_url=callback_url,
        )
        body = json.dumps(
            {"status": "accepted", "call": accepted.call_id, "capability": full, "status_url": accepted.status_url}
        ).encode()
        start_response(
            "202 Accepted",
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Location", accepted.status_url),
                ("Preference-Applied", "respond-async"),
                NOSNIFF,
            ],
        )
        return [body]

    @staticmethod
    def reply_error(start_response, error: SigilError):
        body = error_body(error)
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))), NOSNIFF]
        headers.extend(error_headers(error).items())
        start_response(f"{error.status} {STATUS_TEXT.get(error.status, '')}".rstrip(), headers)
        return [body]


class ResponseBody:
    """Streams the capability's body to the caller; records the call once it has been sent."""

    def __init__(self, gateway: Gateway, upstream, call: Call, route: routes.CachedRoute, *, ok: bool) -> None:
        self.environ: dict = {}
        self.gateway = gateway
        self.upstream = upstream
        self.call = call
        self.route = route
        self.ok = ok
        self.counts = True
        self.message = ""  # for a failure record: the start of a 5xx body, or why it was cut
        self.cache_target: str | None = None
        self.cache_answer: degraded_cache.CachedAnswer | None = None
        self.cache_chunks: list[bytes] = []
        self.cache_complete = False  # the whole body was sent (not cut, not abandoned)

    def keep_for_cache(self, target: str, answer: degraded_cache.CachedAnswer) -> None:
        """Keep the body as it streams, to store it as the last good answer to `target`
        (capabilities that opted in: degraded_cache)."""
        self.cache_target, self.cache_answer = target, answer

    def __iter__(self):
        try:
            if self.cache_answer is None:
                for chunk in self.upstream.stream(STREAM_CHUNK):
                    if not self.ok and not self.message:
                        self.message = _first_line(chunk)
                    yield chunk
                return
            # Only a good answer (2xx) is kept, so there is no failure message to look for.
            room = self.gateway.degraded_cache.max_body_bytes
            for chunk in self.upstream.stream(STREAM_CHUNK):
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
                stopped = runtime.call_stopped(slot=self.route.slot, sent_at=self.call.sent_at)
                # Cut because another call ran its process past a limit: not this one's failure.
                self.counts = stopped is None or stopped.culprit

    def close(self) -> None:
        # WSGI servers call close() after the last byte is written, so this bookkeeping is
        # off the caller's latency.
        self.upstream.release_conn()
        try:
            if self.counts:
                self.gateway.finish(self.call, status=self.upstream.status, ok=self.ok, message=self.message)
            else:
                self.gateway.abandon(self.call)
            if self.cache_answer is not None and self.cache_complete and self.ok:
                answer = dataclasses.replace(
                    self.cache_answer, body=b"".join(self.cache_chunks), stored_epoch=time.time()
                )
                self.gateway.degraded_cache.store(
                    self.gateway.redis, full=self.call.full, target=self.cache_target, answer=answer
                )
        except REDIS_UNREACHABLE as exc:
            # The caller has its answer; only this call's counters and breaker update are lost.
            logger.error("Redis unreachable: the call to %s was not recorded: %s", self.call.full, exc)
        finally:
            log_access(
                self.environ,
                self.upstream.status,
                self.call.started,
                capability=self.call.full,
                page_in_ms=self.call.page_in_ms,
            )


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


# What the gateway keeps in a request's environ while serving it.
REQUEST_ID = "sigil.request_id"  # set by sigil_site/wsgi.py for every request
CAPABILITY = "sigil.capability"  # the full name, once the path is known to name a capability
CALL = "sigil.call"


def log_access(
    environ,
    status: int,
    started: float,
    *,
    capability: str | None,
    page_in_ms: float | None,
    code: str | None = None,
) -> None:
    """One line per gateway request (logger `sigil.access`), its fields as the log's own
    (sigil_site/logs.py: JSON or text, with the time, process and request id), and for an
    answer Sigil wrote as an error, its error code."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    ms = round((time.perf_counter() - started) * 1000, 3)
    method, path = environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")
    access_logger.info(
        "%s %s %d",
        method,
        path,
        status,
        extra={
            "method": method,
            "path": path,
            "capability": capability,
            "status": status,
            "code": code,
            "cold": page_in_ms is not None,
            "page_in_ms": None if page_in_ms is None else round(page_in_ms, 3),
            "ms": ms,
        },
    )


def cache_target(rest: str, query: str | None) -> str:
    """What a degraded capability's cached answers are kept under: the path and query."""
    return rest + ("?" + query if query else "")


def split_path(path: str) -> tuple[str, str, str]:
    """`/agent/capability/rest` → ("agent", "capability", "/rest"); the rest is re-quoted.

    Raises NotFound for paths that cannot name a capability.
    """
    agent, _, tail = path.lstrip("/").partition("/")
    name, slash, rest = tail.partition("/")
    try:
        names.validate_agent_name(agent)
        names.validate_capability_name(name, ephemeral=True)
    except InvalidRequest as exc:
        raise NotFound(f"no capability at {quote(path)}") from exc
    # PATH_INFO arrives percent-decoded (as latin-1); quote it back so the capability sees
    # the path the caller sent.
    return agent, name, "/" + quote(rest.encode("latin-1"), safe="/:@!$&'()*+,;=-._~") if slash else "/"


# Some WSGI servers (granian 2.5) copy the server's own environment into every request's
# environ, so a variable such as HTTP_PROXY would reach capabilities as a header. Such
# entries are recognised by name and value and never forwarded.
SERVER_ENVIRONMENT_HEADERS = {key: value for key, value in os.environ.items() if key.startswith("HTTP_")}


def request_headers(environ) -> dict[str, str]:
    headers = {}
    for key, value in environ.items():
        if key.startswith("HTTP_") and SERVER_ENVIRONMENT_HEADERS.get(key) != value:
            name = key[5:].replace("_", "-").lower()
            if name in DROPPED_REQUEST_HEADERS or name.startswith("x-sigil-"):
                continue
            headers[name] = value
    if environ.get("CONTENT_TYPE"):
        headers["content-type"] = environ["CONTENT_TYPE"]
    return headers


def read_limited(stream, limit: int) -> bytes:
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"the request body is over {limit} bytes")
    return data


def _prefers_async(environ) -> bool:
    return "respond-async" in environ.get("HTTP_PREFER", "")


def _unexpected(environ, exc: Exception) -> SigilError:
    """The contract's answer to `exc`, logged once here with the request id the caller sees."""
    error = error_for_unexpected(exc, request_id=environ.get(REQUEST_ID))
    method, path = environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")
    if isinstance(error, InternalError):
        logger.exception("request %s failed: %s %s", error.request_id, method, quote(path))
    else:
        logger.warning("%s %s answered %s: %s", method, quote(path), error.code, exc)
    return error


def _db_connection_open() -> bool:
    """Whether this thread holds an open database connection (cheap: no I/O)."""
    return connection.connection is not None


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
