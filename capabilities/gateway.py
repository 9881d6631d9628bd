"""The invoke hot path: `ANY /{agent}/{capability}[/rest]` to the capability's code.

A plain WSGI application, mounted in front of Django by sigil_site/wsgi.py, so a call pays
for no middleware, URL resolver or request object. On a warm call it does no SQL: the
token, the route and the breaker come from Redis in one MGET, and the call's counters,
access stamp and breaker update go back in one script call after the response is sent.
"""

from __future__ import annotations

import http.client
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from urllib.parse import quote, urlsplit

import redis
import urllib3
from urllib3.util import parse_url
from django.conf import settings

from agents import tokens
from agents.selectors import parse_bearer, token_authenticate
from capabilities import names, routes, stats
from capabilities.models import BreakerState
from capabilities.runtimes import get_runtime
from capabilities.runtimes.base import Route
from capabilities.tasks import capability_record_breaker as capability_record_breaker_task
from sigil_site.errors import (
    CapabilityError,
    Degraded,
    InvalidRequest,
    NotFound,
    SigilError,
    Timeout,
    TooLarge,
    UpstreamError,
    error_body,
    error_headers,
)
from sigil_site.redis_client import get_redis

logger = logging.getLogger(__name__)

# RFC 9110 §7.6.1 connection-specific fields, never forwarded by a proxy in either direction.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"}
)
# What the gateway drops from the caller's request besides hop-by-hop fields: the caller's
# credentials, and (below) anything posing as Sigil's internal headers.
DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {"authorization"}
STREAM_CHUNK = 64 * 1024


class Gateway:
    """One per process; holds the runtime, the Redis client and the upstream connections."""

    def __init__(self) -> None:
        self.redis = get_redis()
        self.runtime = get_runtime()
        self.record_call = self.redis.register_script(stats.RECORD_CALL)
        self.max_body = settings.SIGIL_INVOKE_MAX_BODY_BYTES
        self.breaker_threshold = settings.SIGIL_BREAKER_THRESHOLD
        self.breaker_cooldown = settings.SIGIL_BREAKER_COOLDOWN_SECONDS
        self.upstream = UpstreamConnections(connect_timeout=5.0, read_timeout=settings.SIGIL_INVOKE_TIMEOUT_SECONDS)
        self.route_memo: dict[tuple[str, str], Route] = {}
        self.local = threading.local()

    def __call__(self, environ, start_response):
        started = time.perf_counter()
        try:
            return self.handle(environ, start_response, started)
        except SigilError as error:
            return self.reply_error(start_response, error)

    def handle(self, environ, start_response, started: float):
        agent, name, rest = split_path(environ.get("PATH_INFO", ""))
        full = names.full_name(agent, name)
        secret = parse_bearer(environ.get("HTTP_AUTHORIZATION"))
        token_hash = tokens.hash_secret(secret)
        keys = (tokens.cache_key(token_hash), routes.key(full), stats.breaker_key(full))
        try:
            token_raw, route_raw, open_until = self.thread_redis().mget(keys)
        except redis.ConnectionError:
            # The held connection was closed (Redis restarted, or dropped an idle client);
            # redis-py has discarded it, so this reconnects, as taking one from the pool did.
            token_raw, route_raw, open_until = self.thread_redis().mget(keys)
        principal = token_authenticate(secret, cached=token_raw)
        if route_raw is None:
            route_raw = routes.route_load(full)
        route = routes.decode(route_raw)
        now = time.time()
        if route is None or (route.agent != principal.agent_name and not route.is_public):
            raise NotFound(f"no capability {full}")
        if route.expires_epoch is not None and route.expires_epoch <= now:
            raise NotFound(f"{full} has expired")

        is_trial = False
        if open_until is not None:
            is_trial = self.enter_open_breaker(full, float(open_until), now)

        cold = False
        if route.state not in routes.SERVED_STATES:
            from capabilities.services import capability_page_in

            route = capability_page_in(full=full)
            cold = True

        target = self.target(route)
        upstream_started = time.perf_counter()
        try:
            upstream = self.send(environ, target, rest)
        except urllib3.exceptions.TimeoutError as exc:
            self.finish(full, token_hash, started, ok=False, is_trial=is_trial)
            raise Timeout(f"{full} did not answer within {self.upstream.read_timeout:g} s") from exc
        except urllib3.exceptions.HTTPError as exc:
            self.release_trial(full, is_trial)
            raise UpstreamError(f"the runtime could not be reached for {full}: {exc.__class__.__name__}") from exc
        upstream_ms = (time.perf_counter() - upstream_started) * 1000

        failure = upstream.headers.get("x-sigil-error")
        if failure is not None:
            return self.reply_runtime_failure(
                start_response, upstream, failure, full=full, token_hash=token_hash, started=started, is_trial=is_trial
            )

        headers = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP]
        sigil_ms = (time.perf_counter() - started) * 1000 - upstream_ms
        headers.append(("X-Sigil-Capability", full))
        headers.append(("Server-Timing", f"sigil;dur={sigil_ms:.2f}, capability;dur={upstream_ms:.2f}"))
        if cold:
            headers.append(("X-Sigil-Cold-Start", "1"))
        start_response(f"{upstream.status} {upstream.reason or ''}".rstrip(), headers)
        return ResponseBody(self, upstream, full, token_hash, started, ok=upstream.status < 500, is_trial=is_trial)

    def thread_redis(self) -> redis.Redis:
        """A client holding one connection for this server thread, for the two commands
        every call sends. Taking a connection from the shared pool costs three system
        calls per command (redis-py checks that it has no unread data), and each lets
        another thread take the GIL."""
        client = getattr(self.local, "redis", None)
        if client is None:
            client = redis.Redis(connection_pool=self.redis.connection_pool, single_connection_client=True)
            self.local.redis = client
        return client

    def enter_open_breaker(self, full: str, open_until: float, now: float) -> bool:
        """While open, refuse; after the cool-down let exactly one trial call through."""
        if now < open_until:
            raise Degraded(f"{full} is degraded after repeated failures", retry_after=open_until - now)
        ttl_ms = int(self.breaker_cooldown * 1000) or 1000
        if not self.redis.set(stats.trial_key(full), 1, nx=True, px=ttl_ms):
            raise Degraded(f"{full} is degraded; a trial call is in progress", retry_after=1)
        return True

    def release_trial(self, full: str, is_trial: bool) -> None:
        if is_trial:
            self.redis.delete(stats.trial_key(full))

    def target(self, route: routes.CachedRoute) -> Route:
        key = (route.slot, route.sha)
        target = self.route_memo.get(key)
        if target is None:
            target = self.runtime.route(slot=route.slot, sha=route.sha)
            if len(self.route_memo) > 10_000:
                self.route_memo.clear()
            self.route_memo[key] = target
        return target

    def send(self, environ, target: Route, rest: str) -> UpstreamResponse:
        headers = request_headers(environ)
        headers.update(target.headers)
        if target.host_header:
            headers["Host"] = target.host_header
        query = environ.get("QUERY_STRING")
        # Normalised as urllib3's pool did it: dot segments resolved, characters that may
        # not appear in a request line percent-encoded.
        url = parse_url(target.base_url + rest + ("?" + query if query else "")).request_uri
        body = None
        size = None
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
        return self.upstream.request(environ["REQUEST_METHOD"], target.base_url, url, headers=headers, body=body, size=size)

    def reply_runtime_failure(self, start_response, upstream, failure: str, *, full, token_hash, started, is_trial):
        message = upstream.data.decode(errors="replace")[:2000]
        upstream.release_conn()
        if failure == "exception":
            self.finish(full, token_hash, started, ok=False, is_trial=is_trial)
            error: SigilError = CapabilityError(f"{full} threw: {_exception_text(message)}")
        else:
            self.release_trial(full, is_trial)
            logger.error("runtime refused a call to %s: %s %s", full, failure, message)
            error = UpstreamError(f"the runtime failed to run {full} ({failure})")
        return self.reply_error(start_response, error)

    def finish(self, full: str, token_hash: str, started: float, *, ok: bool, is_trial: bool) -> None:
        """Record the call in Redis; persist a breaker transition through Celery."""
        now = time.time()
        latency_ms = (time.perf_counter() - started) * 1000
        change = self.record_call(
            client=self.thread_redis(),
            keys=[
                stats.stats_key(full),
                stats.failures_key(full),
                stats.breaker_key(full),
                stats.trial_key(full),
                stats.DIRTY_KEY,
                stats.TOKENS_USED_KEY,
            ],
            args=[full, token_hash, f"{now:.6f}", f"{latency_ms:.3f}", int(ok), int(is_trial),
                  self.breaker_threshold, self.breaker_cooldown],
        )
        if change:
            state = BreakerState.OPEN if change == b"opened" else BreakerState.CLOSED
            capability_record_breaker_task.delay(full=full, state=state, at_epoch=now)

    @staticmethod
    def reply_error(start_response, error: SigilError):
        body = error_body(error)
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        headers.extend(error_headers(error).items())
        start_response(f"{error.status} {STATUS_TEXT.get(error.status, '')}".rstrip(), headers)
        return [body]


class ResponseBody:
    """Streams the capability's body to the caller; records the call once it has been sent."""

    def __init__(self, gateway: Gateway, upstream, full: str, token_hash: str, started: float, *, ok: bool, is_trial: bool):
        self.gateway = gateway
        self.upstream = upstream
        self.full = full
        self.token_hash = token_hash
        self.started = started
        self.ok = ok
        self.is_trial = is_trial

    def __iter__(self):
        try:
            yield from self.upstream.stream(STREAM_CHUNK)
        except urllib3.exceptions.TimeoutError:
            self.ok = False  # the capability stalled mid-body; the caller sees a cut response
            logger.warning("%s stalled while streaming its response", self.full)

    def close(self) -> None:
        # WSGI servers call close() after the last byte is written, so this bookkeeping is
        # off the caller's latency.
        self.upstream.release_conn()
        self.gateway.finish(self.full, self.token_hash, self.started, ok=self.ok, is_trial=self.is_trial)


class UpstreamConnections:
    """Keep-alive HTTP/1.1 connections from this process to the runtimes, on http.client.

    The gateway's upstream calls are plain (no redirects, no retries, no decoding), and a
    call through urllib3's pool cost about 130 µs more CPU than the same call on http.client
    (URL parsing twice, pool keys, retry and timeout objects), over a quarter of a warm
    call's cost in the server (bench/invoke.py). Idle connections are kept per origin and
    reused last in, first out. Failures are raised as the urllib3 exceptions the gateway
    handles, so what a caller sees when the runtime fails is as before.
    """

    # Idle connections kept per origin; a burst beyond it opens (and then closes) extra ones.
    MAX_IDLE = 32
    # What urllib3 sent when the caller sent none, so capabilities see the headers they saw.
    DEFAULT_USER_AGENT = f"python-urllib3/{urllib3.__version__}"
    # urllib3's framing: these methods get no `Content-Length: 0` when they carry no body.
    METHODS_WITHOUT_BODY = frozenset({"GET", "HEAD", "DELETE", "TRACE", "OPTIONS", "CONNECT"})

    def __init__(self, *, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle: dict[str, list[http.client.HTTPConnection]] = {}

    def request(
        self, method: str, base_url: str, url: str, *, headers: dict[str, str], body, size: int | None
    ) -> UpstreamResponse:
        """Send one request (never retried) and return once the response head is read.

        `body` is None, bytes, or a stream of `size` bytes. Raises urllib3's TimeoutError
        (connect or read timeout, or no connection) or HTTPError.
        """
        idle = self.idle.setdefault(base_url, [])
        connection = self.reuse(idle) or self.connect(base_url)
        try:
            given = {name.lower() for name in headers}
            connection.putrequest(
                method, url, skip_host="host" in given, skip_accept_encoding="accept-encoding" in given
            )
            if "user-agent" not in given:
                connection.putheader("User-Agent", self.DEFAULT_USER_AGENT)
            for name, value in headers.items():
                connection.putheader(name, value)
            if "content-length" not in given:
                if body is not None:
                    connection.putheader("Content-Length", str(len(body)))
                elif method.upper() not in self.METHODS_WITHOUT_BODY:
                    connection.putheader("Content-Length", "0")
            connection.endheaders()
            if isinstance(body, bytes):
                connection.send(body)
            elif body is not None:
                while size > 0 and (chunk := body.read(min(size, STREAM_CHUNK))):
                    connection.send(chunk)
                    size -= len(chunk)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise _upstream_error(exc, url) from exc
        except BaseException:
            connection.close()
            raise
        return UpstreamResponse(response, connection, idle)

    def reuse(self, idle: list[http.client.HTTPConnection]) -> http.client.HTTPConnection | None:
        while idle:
            try:
                connection = idle.pop()
            except IndexError:  # another thread took the last one
                return None
            # Readable while idle means the peer closed it: drop it rather than send a
            # request that would fail, since requests are never retried.
            if connection.sock is not None and not _readable(connection.sock):
                return connection
            connection.close()
        return None

    def connect(self, base_url: str) -> http.client.HTTPConnection:
        origin = urlsplit(base_url)
        factory = http.client.HTTPSConnection if origin.scheme == "https" else http.client.HTTPConnection
        connection = factory(origin.hostname, origin.port, timeout=self.connect_timeout)
        try:
            connection.connect()
        except socket.timeout as exc:
            raise urllib3.exceptions.ConnectTimeoutError(f"connecting to {base_url} timed out") from exc
        except ssl.SSLError as exc:
            raise urllib3.exceptions.SSLError(exc) from exc
        except OSError as exc:
            raise urllib3.exceptions.NewConnectionError(connection, f"cannot connect to {base_url}: {exc}") from exc
        connection.sock.settimeout(self.read_timeout)
        return connection


class UpstreamResponse:
    """The runtime's answer; its connection goes back to the pool once the body is read."""

    def __init__(self, response: http.client.HTTPResponse, connection: http.client.HTTPConnection, idle: list):
        self.status = response.status
        self.reason = response.reason
        self.headers = response.headers
        self.response = response
        self.connection = connection
        self.idle = idle

    @property
    def data(self) -> bytes:
        return b"".join(self.stream(STREAM_CHUNK))

    def stream(self, amount: int) -> Iterator[bytes]:
        # A chunked body is passed on chunk by chunk as it arrives (a capability may stream);
        # one of known length in reads of up to `amount`, as urllib3 did.
        read = self.response.read1 if self.response.chunked else self.response.read
        try:
            while chunk := read(amount):
                yield chunk
            if self.response.length:
                raise http.client.IncompleteRead(b"", self.response.length)
        except (OSError, http.client.HTTPException) as exc:
            raise _upstream_error(exc, "the response body") from exc

    def release_conn(self) -> None:
        """Keep the connection if the body was read to its end; close it otherwise."""
        connection, self.connection = self.connection, None
        if connection is None:
            return
        if self.response.isclosed() and not self.response.will_close and len(self.idle) < UpstreamConnections.MAX_IDLE:
            self.idle.append(connection)
        else:
            connection.close()


def _upstream_error(exc: OSError | http.client.HTTPException, what: str) -> urllib3.exceptions.HTTPError:
    """urllib3's exception for a failure of http.client or the socket under it."""
    if isinstance(exc, socket.timeout):
        return urllib3.exceptions.ReadTimeoutError(None, what, f"read timed out: {exc}")
    return urllib3.exceptions.ProtocolError(f"connection failed: {exc!r}", exc)


def _readable(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


STATUS_TEXT = {
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 409: "Conflict",
    413: "Content Too Large", 429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway",
    503: "Service Unavailable", 504: "Gateway Timeout",
}


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


def request_headers(environ) -> dict[str, str]:
    headers = {}
    for key, value in environ.items():
        if key.startswith("HTTP_"):
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


def _exception_text(host_message: str) -> str:
    import json

    try:
        return json.loads(host_message)["message"].splitlines()[0][:500]
    except (ValueError, KeyError, IndexError, TypeError):
        return host_message[:500]
