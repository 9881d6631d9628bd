"""The invoke hot path: `ANY /{agent}/{capability}[/rest]` to the capability's code.

A plain WSGI application, mounted in front of Django by sigil_site/wsgi.py, so a call pays
for no middleware, URL resolver or request object. On a warm call it does no SQL: the
token, the route and the breaker come from Redis in one MGET, and the call's counters,
access stamp and breaker update go back in one script call after the response is sent.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from urllib.parse import quote

import redis
from django.conf import settings
from django.db import close_old_connections, connection
from urllib3.util import parse_url

from agents import tokens
from agents.selectors import parse_bearer, token_authenticate
from agents.throttle import FailedAuthThrottle
from capabilities import breaker, names, pager, routes, stats
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
    InternalError,
    InvalidRequest,
    NotFound,
    SigilError,
    Timeout,
    TooLarge,
    Unauthenticated,
    Unavailable,
    UpstreamError,
    error_body,
    error_for_unexpected,
    error_headers,
)
from sigil_site.redis_client import get_redis

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
# What a 202 tells the caller to expect: a page-in is one upload, usually about a second.
WARMING_ETA_SECONDS = 3


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
        "sent_at",
        "started",
        "token_hash",
    )

    def __init__(self, full: str, capability_type: str, token_hash: str, started: float, is_trial: bool) -> None:
        self.full = full
        self.capability_type = capability_type
        self.token_hash = token_hash
        self.started = started
        self.is_trial = is_trial
        self.holds_inflight = False
        self.finished = False
        self.page_in_ms: float | None = None
        self.sent_at = 0.0  # epoch the request left for the runtime


class Gateway:
    """One per process; holds the runtime, the Redis client and the upstream connection pools."""

    def __init__(self) -> None:
        self.redis = get_redis()
        self.runtime = get_runtime()
        self.record_call = self.redis.register_script(stats.RECORD_CALL)
        self.max_body = settings.SIGIL_INVOKE_MAX_BODY_BYTES
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
        sent = []

        def start_and_remember(status, headers, exc_info=None):
            sent.append(status)
            return start_response(status, headers, exc_info)

        try:
            result = self.handle(environ, start_and_remember, started)
        except SigilError as error:
            result = self.reply_error(start_and_remember, error)
        except Exception as exc:
            # The edge answers in the contract, always: a bug or an unreachable Redis still
            # gets the envelope and its access-log line, never the server's bare 500.
            if sent:
                raise  # the status line is out; the server can only cut the response
            result = self.reply_error(start_and_remember, _unexpected(environ, exc))
        try:
            if isinstance(result, ResponseBody):
                result.environ = environ  # logged when the body has been sent
            else:
                log_access(environ, int(sent[0][:3]), started, capability=None, page_in_ms=None)
            return result
        finally:
            if _db_connection_open() != connection_was_open:
                # The cold path touched the database: end the connection's life as Django
                # does after a request (CONN_MAX_AGE), since no Django handler runs here.
                close_old_connections()

    def handle(self, environ, start_response, started: float):
        agent, name, rest = split_path(environ.get("PATH_INFO", ""))
        full = names.full_name(agent, name)
        authorization = environ.get("HTTP_AUTHORIZATION")
        if authorization is not None and SERVER_ENVIRONMENT_HEADERS.get("HTTP_AUTHORIZATION") == authorization:
            authorization = None  # the server's environment, not the caller's header
        secret = parse_bearer(authorization)
        token_hash = tokens.hash_secret(secret)
        address = self.auth_throttle.address(environ)
        keys = (
            tokens.cache_key(token_hash),
            routes.key(full),
            breaker.open_key(full),
            self.auth_throttle.key(address),
        )
        try:
            token_raw, route_raw, breaker_raw, auth_failures = self.thread_redis().mget(keys)
        except redis.ConnectionError:
            # The held connection was closed (Redis restarted, or dropped an idle client);
            # redis-py has discarded it, so this reconnects.
            token_raw, route_raw, breaker_raw, auth_failures = self.thread_redis().mget(keys)
        principal = self.authenticate(secret, token_raw, address, auth_failures)
        if route_raw is None:
            route_raw = routes.route_load(full)
        route = routes.decode(route_raw)
        now = time.time()
        if route is None or (route.agent != principal.agent_name and not route.is_public):
            raise NotFound(f"no capability {full}")
        if route.expires_epoch is not None and route.expires_epoch <= now:
            raise NotFound(f"{full} has expired")

        is_trial = False
        if breaker_raw is not None:  # not closed: open, half-open or forced
            is_trial = self.breaker.enter(self.redis, full=full, raw=breaker_raw, now=now)
        call = Call(full, route.type, token_hash, started, is_trial)
        try:
            return self.forward(environ, start_response, call, route, rest)
        finally:
            if not call.finished:
                self.abandon(call)

    def authenticate(self, secret: str, token_raw: bytes | None, address: str, auth_failures: bytes | None):
        """The caller's principal, unless its address is throttled (agents.throttle)."""
        self.auth_throttle.check(self.redis, address, auth_failures)
        try:
            return token_authenticate(secret, cached=token_raw)
        except Unauthenticated:
            self.auth_throttle.failed(self.redis, address)
            raise

    def forward(self, environ, start_response, call: Call, route: routes.CachedRoute, rest: str):
        page_in_ms = None
        if route.state not in routes.SERVED_STATES:
            if _prefers_async(environ):
                return self.reply_warming(start_response, call)
            route, page_in_ms = self.page_in(call.full)
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
            try:
                route, page_in_ms = self.page_in(call.full)
            except Timeout:
                if not _prefers_async(environ):
                    raise
                return self.reply_warming(start_response, call)  # another call is placing it
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
        headers.append(("X-Sigil-Capability", call.full))
        if page_in_ms is not None:
            headers.append(("X-Sigil-Cold-Start", "1"))
            timing += f", page-in;dur={page_in_ms:.2f}"
        headers.append(("Server-Timing", timing))
        start_response(f"{upstream.status} {upstream.reason or ''}".rstrip(), headers)
        call.finished = True  # from here ResponseBody.close() records the call
        return ResponseBody(self, upstream, call, route, ok=upstream.status < 500)

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

    def page_in(self, full: str) -> tuple[routes.CachedRoute, float]:
        from capabilities.services import capability_page_in

        started = time.perf_counter()
        # Waiting on another call's page-in is bounded as the call itself is (then Timeout).
        route, _ = capability_page_in(full=full, wait_seconds=self.upstream.read_timeout)
        return route, (time.perf_counter() - started) * 1000

    def send_once(self, environ, call: Call, route: routes.CachedRoute, rest: str) -> UpstreamResponse:
        call.sent_at = sent_at = time.time()
        try:
            return self.send(environ, self.target(route), rest)
        except UpstreamTimeout as exc:
            self.finish(call, ok=False)
            raise Timeout(f"{call.full} did not answer within {self.upstream.read_timeout:g} s") from exc
        except UpstreamUnreachable as exc:
            stopped = runtime_for(route.backend).call_stopped(slot=route.slot, sent_at=sent_at)
            if stopped is None:
                raise UpstreamError(f"the runtime could not be reached for {call.full}: {exc}") from exc
            if not stopped.culprit:
                # It shared a process with a call that ran past a limit, or found it restarting:
                # not this capability's failure, so its breaker is left alone.
                raise Unavailable(
                    f"{call.full} was interrupted: another call in its runtime process {stopped.message}; "
                    "a fresh process is starting",
                    retry_after=1,
                ) from exc
            self.finish(call, ok=False)
            raise stopped_at_limit(call.full, stopped.message, cpu=stopped.reason == "cpu") from exc

    def target(self, route: routes.CachedRoute) -> Route:
        # The route's own runtime: while `switchbackend` moves capabilities, some are still
        # placed on the previous one, and are served there until their move is recorded.
        key = (route.backend, route.slot, route.sha, route.cpu_ms)
        target = self.route_memo.get(key)
        if target is None:
            try:
                target = runtime_for(route.backend).route(slot=route.slot, sha=route.sha, cpu_ms=route.cpu_ms)
            except RuntimeUnavailable as exc:  # e.g. Cloudflare failing when asked for the account's subdomain
                raise UpstreamError(f"the runtime could not say where slot {route.slot} answers: {exc}") from exc
            if len(self.route_memo) > 10_000:
                self.route_memo.clear()
            self.route_memo[key] = target
        return target

    def send(self, environ, target: Route, rest: str) -> UpstreamResponse:
        headers = request_headers(environ)
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

    def finish(self, call: Call, *, ok: bool) -> None:
        """Record a call that reached the capability, in one Redis round trip; persist a
        breaker transition through Celery."""
        call.finished = True
        now = time.time()
        latency_ms = (time.perf_counter() - call.started) * 1000
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
            ],
        )
        breaker.breaker_changed(full=call.full, change=change, at_epoch=now)

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
            self.finish(call, ok=False)
            error: SigilError = CapabilityError(f"{call.full} threw: {_exception_text(message)}")
        elif failure in (EXCEEDED_CPU, EXCEEDED_LIMITS):
            # The capability's own doing: it counts toward its breaker, and no other's. Worded
            # and classed as the local runtime's stops are: 504 for CPU, else 502.
            self.finish(call, ok=False)
            if failure == EXCEEDED_CPU:
                error = stopped_at_limit(call.full, _runtime_message(message, "ran past its CPU limit"), cpu=True)
            else:
                error = stopped_at_limit(call.full, "ran past its resource limits (CPU time or memory)", cpu=False)
        else:
            logger.error("runtime refused a call to %s: %s %s", call.full, failure, message)
            error = UpstreamError(f"the runtime failed to run {call.full} ({failure})")
        return self.reply_error(start_response, error)

    def reply_redirect(self, start_response, call: Call, target: Route, rest: str, query: str | None, page_in_ms):
        """SIGIL_POOL_REDIRECT: send the caller to the script's own URL (the seed's 302)."""
        call.page_in_ms = page_in_ms
        self.finish(call, ok=True)
        location = target.base_url + rest + ("?" + query if query else "")
        headers = [("Location", location), ("Content-Length", "0"), ("X-Sigil-Capability", call.full), NOSNIFF]
        if page_in_ms is not None:
            headers.append(("X-Sigil-Cold-Start", "1"))
        start_response("302 Found", headers)
        return [b""]

    def reply_warming(self, start_response, call: Call):
        """`Prefer: respond-async` on a cold capability: page it in behind a 202."""
        from capabilities.tasks import capability_page_in as capability_page_in_task

        capability_page_in_task.delay(full=call.full)
        body = json.dumps(
            {"status": "warming", "callback": f"/_status/{call.full}", "eta_seconds": WARMING_ETA_SECONDS}
        ).encode()
        start_response(
            "202 Accepted",
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
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

    def __iter__(self):
        try:
            yield from self.upstream.stream(STREAM_CHUNK)
        except (UpstreamTimeout, UpstreamUnreachable) as exc:
            self.ok = False  # the capability stalled or broke mid-body; the caller sees a cut response
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
                self.gateway.finish(self.call, ok=self.ok)
            else:
                self.gateway.abandon(self.call)
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


def log_access(environ, status: int, started: float, *, capability: str | None, page_in_ms: float | None) -> None:
    """One JSON line per gateway request (logger `sigil.access`).

    Built by hand rather than with json.dumps of a dict: this runs on every call, and only
    the path (the caller's text) needs escaping; the method is an HTTP token and the
    capability a validated name.
    """
    if not access_logger.isEnabledFor(logging.INFO):
        return
    ms = (time.perf_counter() - started) * 1000
    access_logger.info(
        '{"time":%.3f,"method":"%s","path":%s,"capability":%s,"status":%d,"cold":%s,"page_in_ms":%s,"ms":%.3f}',
        time.time(),
        environ.get("REQUEST_METHOD", ""),
        json.dumps(environ.get("PATH_INFO", "")),
        f'"{capability}"' if capability else "null",
        status,
        "false" if page_in_ms is None else "true",
        "null" if page_in_ms is None else f"{page_in_ms:.3f}",
        ms,
    )


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
    error = error_for_unexpected(exc)
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


def _exception_text(host_message: str) -> str:
    try:
        return json.loads(host_message)["message"].splitlines()[0][:500]
    except (ValueError, KeyError, IndexError, TypeError):
        return host_message[:500]
