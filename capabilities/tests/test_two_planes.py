"""One contract, two planes: the same calls through the origin (Sigil's server, the Python
engine) and through the edge (Sigil's Worker on the emulator, from the state published to its
Workers KV), on each runtime that has the edge, answered alike: the status, the headers that
matter, the body and the error code.

The capabilities, agents and tokens are set up once per runtime (the module's `planes`), and
each case is a test of its own, so a failure names its case and its runtime. A publisher runs
beside them as beat runs it, every SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS (compressed here to
PUBLISH_INTERVAL); the cases where the planes must differ for a while (a change the origin
applies at once and the edge only once it is published: `propagation` in their names) pause
it, show the difference, let it publish and wait for the edge to agree within the bound.

Requests go out as raw HTTP/1.1 (http.client), so a path reaches each plane exactly as written
(a client library would resolve its dot segments first)."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import shutil
import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
import redis as redis_lib
from django.test import override_settings
from django.utils import timezone

from sigil import redis_keys
from testsupport.capability_code import ECHO, FLAKY, PONG, STREAMS, answering
from testsupport.cast import wait_for

RUNTIMES = ["platform", "loader", "worker-pool"]
EDGE_WORKERS = {"platform": "sigil-dispatcher", "loader": "sigil-loader", "worker-pool": "sigil-edge"}
PUBLISH_INTERVAL = 0.5
# What the edge may take to agree with the origin once a change is published: the publisher's
# interval, KV's propagation (none here: the emulator is told so), the isolate's memory of what
# it read (1 s), and room for a loaded machine.
PROPAGATION_BOUND = PUBLISH_INTERVAL + 1.0 + 8.0
MAX_BODY = 64
BREAKER_THRESHOLD = 2

# Throws when called with ?throw, answers "fine" otherwise.
THROWS = """export default { async fetch(request) {
  if (new URL(request.url).searchParams.has('throw')) throw new Error('kaput\\nsecond line');
  return new Response('fine');
} }"""
# Echoes a WebSocket's messages; refuses an upgrade with ?refuse, and answers a request that
# asks for none with a 426.
ECHO_SOCKET = """export default { async fetch(request) {
  if (new URL(request.url).searchParams.has('refuse')) {
    return new Response('not this one', { status: 403, headers: { 'x-why': 'asked to' } });
  }
  if (request.headers.get('upgrade') !== 'websocket') return new Response('send an upgrade', { status: 426 });
  const [client, server] = Object.values(new WebSocketPair());
  server.accept();
  server.addEventListener('message', (event) => server.send(event.data));
  return new Response(null, { status: 101, webSocket: client });
} }"""


# The cases use the test database (so the session sets it up), but share their runtime's rows
# (see `planes`, which empties the database once its cases are done): neither the database nor
# Redis is emptied between them.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _django_db_marker():
    """The database stays as `planes` left it from one case to the next."""


@pytest.fixture(autouse=True)
def _fresh_redis_and_runtime():
    """Redis and the emulator stay as `planes` left them from one case to the next."""


# --- the answers and how they are compared ---------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-cased names; a repeated header joined with ", "
    body: bytes
    request_id: str | None = None

    def error_code(self) -> str | None:
        try:
            return json.loads(self.body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return None


# The headers that must be the same on both planes, value for value.
SAME_HEADERS = (
    "content-type",
    "retry-after",
    "www-authenticate",
    "x-content-type-options",
    "x-sigil-capability",
    "x-sigil-version",
    "x-sigil-cold-start",
    "x-echo",
    "set-cookie",
    "preference-applied",
    "x-why",
    "content-length",
)
# The headers that must be on both or on neither (their values are each call's own).
PRESENT_HEADERS = ("x-request-id", "server-timing")


def view(answer: Answer, *, body=None) -> dict:
    """What of an answer must be the same on both planes. `body` reads the body the planes must
    agree on (the body itself when not given)."""
    timing = answer.headers.get("server-timing")
    return {
        "status": answer.status,
        "code": answer.error_code(),
        "headers": {name: answer.headers.get(name) for name in SAME_HEADERS},
        "present": {name: name in answer.headers for name in PRESENT_HEADERS},
        "timing": None if timing is None else [part.split(";")[0].strip() for part in timing.split(",")],
        "body": answer.body if body is None else body(answer.body),
    }


def echoed(body: bytes) -> dict:
    """What ECHO saw of the request that both planes must pass alike."""
    seen = json.loads(body)
    headers = seen["headers"]
    return {
        "method": seen["method"],
        "path": seen["path"],
        "query": seen["query"],
        "body": seen["body"],
        "headers": {name: headers.get(name) for name in ("content-type", "x-custom", "accept")},
        "sigil's own": sorted(name for name in headers if name.startswith("x-sigil-") or name == "authorization"),
        "request id": len(headers.get("x-request-id", "")),
    }


def send(
    base: str,
    method: str,
    path: str,
    *,
    headers: dict | None = None,
    body=None,
    chunked: bool = False,
    host: str | None = None,
) -> Answer:
    """One request, its path sent exactly as written, on a connection of its own (to `host`
    when given, else to the base's)."""
    parts = urlsplit(base)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.putrequest(method, parts.path + path, skip_host=True, skip_accept_encoding=True)
        sent = {"Host": host or parts.netloc, **(headers or {})}
        if chunked:
            sent["Transfer-Encoding"] = "chunked"
        elif body is not None:
            sent["Content-Length"] = str(len(body))
        for name, value in sent.items():
            connection.putheader(name, value)
        if chunked:
            connection.endheaders()
            for chunk in body:
                connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            connection.send(b"0\r\n\r\n")
        else:
            connection.endheaders(body)
        response = connection.getresponse()
        data = response.read()
        joined: dict[str, str] = {}
        for name, value in response.getheaders():
            name = name.lower()
            joined[name] = f"{joined[name]}, {value}" if name in joined else value
        return Answer(response.status, joined, data, joined.get("x-request-id"))
    finally:
        connection.close()


# --- the shared setup ------------------------------------------------------------------------


class AccessLines(logging.Handler):
    """The origin's access log (`sigil.access`) for the whole module."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []
        from sigil.logs import SigilFormatter

        self.as_json = SigilFormatter(kind="json")

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.as_json.format(record)))


class Publisher:
    """The edge's publisher as beat runs it, every PUBLISH_INTERVAL; `held()` holds it back."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.hold = threading.Lock()
        self.thread = threading.Thread(target=self.run, name="edge-publisher", daemon=True)

    def run(self) -> None:
        from django.db import connection

        from capabilities import tasks

        try:
            while not self.stop.wait(PUBLISH_INTERVAL):
                with self.hold:
                    try:
                        tasks.edge_publish()
                    except Exception:  # as beat would, it runs again at its next tick
                        logging.getLogger(__name__).exception("the edge's publisher failed")
        finally:
            connection.close()

    @contextlib.contextmanager
    def held(self):
        with self.hold:
            yield


@dataclass
class Planes:
    """One runtime's two planes and what the cases call on them."""

    runtime: str
    origin: str  # Sigil's server
    edge: str  # the edge's workers.dev URL, through the emulator's door
    edge_host: str  # the edge's workers.dev host
    emulator: object
    access: AccessLines
    publisher: Publisher
    deployer: object  # alice's client of the control API
    tokens: dict[str, str] = field(default_factory=dict)
    variants: dict[str, str] = field(default_factory=dict)

    def auth(self, who: str = "alice") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def both(self, method: str, path: str, **kwargs) -> tuple[Answer, Answer]:
        return send(self.origin, method, path, **kwargs), send(self.edge, method, path, **kwargs)

    def crossed_origin(self, answer: Answer) -> bool:
        """Whether the origin served `answer` (its own access line, not an edge report's)."""
        from testsupport.inflight import SERVER_REQUESTS

        assert answer.request_id, f"an answer without X-Request-Id: {answer}"
        for server in SERVER_REQUESTS:
            assert server.wait_idle(timeout=10)
        return any(
            line.get("request_id") == answer.request_id and not line.get("at_edge") for line in self.access.lines
        )

    def at_edge(self, call, *, until=lambda answer: True, what: str, timeout: float = 20) -> Answer:
        last = []

        def served():
            answer = call()
            last[:] = [answer]
            return [answer] if until(answer) and not self.crossed_origin(answer) else None

        try:
            return wait_for(served, timeout=timeout, interval=0.2, message=what)[0]
        except AssertionError as failed:
            answer = last[0] if last else None
            seen = answer and (answer.status, bytes(answer.body[:200]), self.crossed_origin(answer))
            raise AssertionError(f"{failed}; its last answer (status, body, from the origin): {seen}") from None


def deployed(agent, **body) -> dict:
    answer = agent.deploy(**body)
    assert answer.status_code in (200, 201), answer.text
    return answer.json()


def split(agent, full: str, weight: int) -> None:
    answer = agent.session.put(
        f"{agent.base_url}/_api/capabilities/{full}/split",
        json={"weight": weight, "caller_header": "X-User"},
        headers=agent.headers(agent.deploy_token),
        timeout=60,
    )
    assert answer.status_code == 200, answer.text


@pytest.fixture(scope="module", params=RUNTIMES)
def planes(request, django_db_blocker, _sigil_server_thread, cf_emulator, _celery_workers):
    """One runtime with the edge on, set up once for every case: alice's capabilities (an echo,
    a public one, splits at 0, 50 and 100 %, breakers forced, open and half-open, a stream, a
    WebSocket echo, one that throws, and the ones the propagation cases change), bob and a
    disabled carol, tokens valid, expired and revoked; all published, and each capability
    served at the edge before the first case."""
    from django.conf import settings
    from django.core.management import call_command

    from agents import services as agent_services
    from agents import tokens as token_rules
    from agents.models import Agent, Token
    from capabilities import services
    from capabilities.books import breaker, routes
    from capabilities.models import Capability
    from capabilities.runtimes import runtimes_forget
    from conftest import _left_idle
    from sigil.edge_state import edge_mark, route_key
    from sigil.redis_client import get_redis
    from testsupport.cast import make_agent

    runtime = request.param
    port, app = _sigil_server_thread
    origin = f"http://127.0.0.1:{port}"
    cf_emulator.reset()
    cf_emulator.configure(kv_miss_cache_seconds=0, kv_propagation_seconds=0)
    overrides = {
        "SIGIL_BACKEND": runtime,
        "SIGIL_EDGE": True,
        "SIGIL_ORIGIN_URL": origin,
        "CF_API_BASE": cf_emulator.api_base,
        "CF_ACCOUNT_ID": cf_emulator.account_id,
        "CF_API_TOKEN": cf_emulator.token,
        "SIGIL_CF_WORKERS_BASE": cf_emulator.url,
        "SIGIL_DEPLOY_WAIT_SECONDS": 60,
        "SIGIL_DEPLOY_COOLDOWN_SECONDS": 0,
        "SIGIL_INVOKE_MAX_BODY_BYTES": MAX_BODY,  # the edge is uploaded with it
        "SIGIL_BREAKER_THRESHOLD": BREAKER_THRESHOLD,
        "SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS": PUBLISH_INTERVAL,
    }
    if runtime == "worker-pool":
        overrides["SIGIL_LOGS_ENABLED"] = False  # the system script is the edge's (conftest's worker_pool)
    access = AccessLines()
    access_logger = logging.getLogger("sigil.access")
    level = access_logger.level
    access_logger.setLevel(logging.INFO)
    access_logger.addHandler(access)
    publisher = Publisher()
    with contextlib.ExitStack() as stack:
        stack.enter_context(django_db_blocker.unblock())
        stack.enter_context(override_settings(**overrides))
        client = redis_lib.Redis.from_url(settings.REDIS_URL)
        client.flushdb()
        client.close()
        shutil.rmtree(settings.SIGIL_CODE_DIR / "slots", ignore_errors=True)
        runtimes_forget()
        app.reset_engine()
        try:
            with _left_idle(["celery", settings.SIGIL_DEPLOY_QUEUE]):
                alice = make_agent("alice", origin)
                bob = make_agent("bob", origin)
                carol = make_agent("carol", origin)
                alice_agent = Agent.objects.get(name="alice")
                _, expired = agent_services.token_issue(
                    agent=alice_agent,
                    scope="invoke",
                    actor="owner:test",
                    expires_at=timezone.now() - timedelta(minutes=1),
                )
                _, revoked = agent_services.token_issue(agent=alice_agent, scope="invoke", actor="owner:test")
                _, other = agent_services.token_issue(agent=alice_agent, scope="invoke", actor="owner:test")
                _, late = agent_services.token_issue(agent=alice_agent, scope="invoke", actor="owner:test")
                agent_services.token_revoke(
                    token=Token.objects.get(secret_hash=token_rules.hash_secret(revoked)), actor="owner:test"
                )
                agent_services.agent_set_active(
                    agent=Agent.objects.get(name="carol"), is_active=False, actor="owner:test"
                )

                deployed(alice, name="echo", code=ECHO)
                deployed(alice, name="public", code=PONG, public=True)
                for weight in (0, 50, 100):
                    deployed(alice, name=f"split{weight}", code=answering("current"))
                    deployed(alice, name=f"split{weight}", code=answering("staged"), stage=True)
                    split(alice, f"alice--split{weight}", weight)
                deployed(alice, name="latesplit", code=answering("current"))
                deployed(alice, name="latesplit", code=answering("staged"), stage=True)
                split(alice, "alice--latesplit", 0)
                for name in ("forced", "open", "halfopen", "late"):
                    deployed(alice, name=name, code=FLAKY)
                deployed(alice, name="streams", code=STREAMS)
                deployed(alice, name="throws", code=THROWS)
                deployed(alice, name="ws", code=ECHO_SOCKET)

                services.capability_force_degraded(
                    capability=Capability.objects.get(full_name="alice--forced"), actor="owner:test"
                )
                # Tripped as failures trip a breaker, through the origin.
                for name in ("open", "halfopen"):
                    for _ in range(BREAKER_THRESHOLD):
                        failed = send(origin, "GET", f"/alice/{name}?fail", headers=alice.headers(alice.invoke_token))
                        assert failed.status == 500, failed
                    assert breaker.breaker_describe(full=f"alice--{name}").status == breaker.Status.OPEN
                # The half-open one's cool-down has passed: its open key holds a time gone by.
                get_redis().set(redis_keys.breaker_open("alice--halfopen"), str(time.time() - 1))
                edge_mark(route_key("alice--halfopen"))

                planes = Planes(
                    runtime=runtime,
                    origin=origin,
                    edge=f"{cf_emulator.url}/{EDGE_WORKERS[runtime]}.{cf_emulator.subdomain}.workers.dev",
                    edge_host=f"{EDGE_WORKERS[runtime]}.{cf_emulator.subdomain}.workers.dev",
                    emulator=cf_emulator,
                    access=access,
                    publisher=publisher,
                    deployer=alice,
                    tokens={
                        "alice": alice.invoke_token,
                        "alice-deploy": alice.deploy_token,
                        "alice-other": other,
                        "bob": bob.invoke_token,
                        "carol": carol.invoke_token,
                        "expired": expired,
                        "revoked": revoked,
                        "late": late,
                    },
                    variants={
                        weight: routes.variant_name(Capability.objects.get(full_name=f"alice--split{weight}"))
                        for weight in (0, 50, 100)
                    },
                )
                publisher.thread.start()
                # Every token and route published, and each capability served at the edge.
                for who in ("alice", "alice-deploy", "alice-other", "bob", "late"):
                    planes.at_edge(
                        lambda who=who: send(planes.edge, "GET", "/alice/public", headers=planes.auth(who)),
                        what=f"the edge to serve alice--public to {who}",
                    )
                for name in ("echo", "split0", "split50", "split100", "latesplit", "late", "streams", "ws", "throws"):
                    planes.at_edge(
                        lambda name=name: send(planes.edge, "GET", f"/alice/{name}", headers=planes.auth()),
                        what=f"the edge to serve alice--{name}",
                    )
                for name in ("forced", "open"):
                    planes.at_edge(
                        lambda name=name: send(planes.edge, "GET", f"/alice/{name}", headers=planes.auth()),
                        until=lambda answer: answer.status == 503,
                        what=f"the edge to refuse the degraded alice--{name}",
                    )
                for who in ("expired", "revoked", "carol"):
                    planes.at_edge(
                        lambda who=who: send(planes.edge, "GET", "/alice/public", headers=planes.auth(who)),
                        until=lambda answer: answer.status == 401,
                        what=f"the edge to refuse {who}'s token",
                    )
                yield planes
        finally:
            publisher.stop.set()
            if publisher.thread.is_alive():
                publisher.thread.join(30)
            access_logger.removeHandler(access)
            access_logger.setLevel(level)
            cf_emulator.reset()
            runtimes_forget()
            app.reset_engine()
            call_command("flush", interactive=False, verbosity=0)
            client = redis_lib.Redis.from_url(settings.REDIS_URL)
            client.flushdb()
            client.close()


# --- the cases -------------------------------------------------------------------------------

CASES = {}


def case(name: str, *, at: str = "edge"):
    """A case of the corpus: `at` is where the edge's answer comes from, "edge" when the edge
    answers itself, "origin" when it must hand the call to the origin (None: not a call, which
    the edge always hands on, and the origin's access log does not name)."""

    def register(function):
        CASES[name] = (function, at)
        return function

    return register


def alike(origin: Answer, edge: Answer, **how) -> None:
    assert view(edge, **how) == view(origin, **how)


@case("valid token")
def _(planes):
    origin, edge = planes.both("GET", "/alice/echo", headers=planes.auth())
    alike(origin, edge, body=echoed)
    assert origin.status == 207
    return edge


@case("expired token")
def _(planes):
    origin, edge = planes.both("GET", "/alice/echo", headers=planes.auth("expired"))
    alike(origin, edge)
    assert origin.error_code() == "unauthenticated"
    return edge


@case("revoked token")
def _(planes):
    origin, edge = planes.both("GET", "/alice/echo", headers=planes.auth("revoked"))
    alike(origin, edge)
    assert origin.error_code() == "unauthenticated"
    return edge


@case("disabled agent's token")
def _(planes):
    origin, edge = planes.both("GET", "/alice/public", headers=planes.auth("carol"))
    alike(origin, edge)
    assert origin.error_code() == "unauthenticated" and "disabled" in json.loads(origin.body)["error"]["message"]
    return edge


@case("no token")
def _(planes):
    origin, edge = planes.both("GET", "/alice/echo")
    alike(origin, edge)
    assert origin.status == 401
    return edge


@case("not a bearer token")
def _(planes):
    origin, edge = planes.both("GET", "/alice/echo", headers={"Authorization": "Basic YWxpY2U6eA=="})
    alike(origin, edge)
    assert origin.status == 401
    return edge


@case("a lower-case bearer scheme")
def _(planes):
    headers = {"Authorization": f"bearer {planes.tokens['alice']}"}
    origin, edge = planes.both("GET", "/alice/echo", headers=headers)
    alike(origin, edge, body=echoed)
    assert origin.status == 207
    return edge


@case("an empty bearer token")
def _(planes):
    origin, edge = planes.both("GET", "/alice/echo", headers={"Authorization": "Bearer "})
    alike(origin, edge)
    assert origin.status == 401
    return edge


@case("unknown token", at="origin")
def _(planes):
    origin, edge = planes.both("GET", "/alice/echo", headers={"Authorization": "Bearer sgl_never-issued"})
    alike(origin, edge)
    assert origin.status == 401
    return edge


@case("deploy token calls")
def _(planes):
    origin, edge = planes.both("GET", "/alice/echo", headers=planes.auth("alice-deploy"))
    alike(origin, edge, body=echoed)
    assert origin.status == 207
    return edge


@case("invoke token deploys", at=None)
def _(planes):
    body = json.dumps({"name": "nope", "code": PONG}).encode()
    headers = {**planes.auth(), "Content-Type": "application/json"}
    origin, edge = planes.both("POST", "/_api/deploy", headers=headers, body=body)
    alike(origin, edge, body=lambda body: json.loads(body)["error"]["code"])
    assert origin.status == 403
    return edge


@case("another agent's private capability")
def _(planes):
    origin, edge = planes.both("GET", "/alice/echo", headers=planes.auth("bob"))
    alike(origin, edge)
    assert origin.status == 404
    return edge


@case("another agent's public capability")
def _(planes):
    origin, edge = planes.both("GET", "/alice/public", headers=planes.auth("bob"))
    alike(origin, edge)
    assert (origin.status, origin.body) == (200, b"pong")
    return edge


@case("unknown capability", at="origin")
def _(planes):
    origin, edge = planes.both("GET", "/alice/nothing-here", headers=planes.auth())
    alike(origin, edge)
    assert origin.status == 404
    return edge


@case("unknown agent", at="origin")
def _(planes):
    origin, edge = planes.both("GET", "/nobody/echo", headers=planes.auth())
    alike(origin, edge)
    assert origin.status == 404
    return edge


@case("invalid name")
def _(planes):
    origin, edge = planes.both("GET", "/alice/Bad_Name", headers=planes.auth())
    alike(origin, edge)
    assert origin.status == 404
    return edge


def split_case(weight: int, by: str):
    @case(f"split at {weight} % by {by}")
    def _(planes):
        variant = planes.variants[weight]
        if by == "header":
            keys = [f"user-{n}" for n in range(12)]
            answers = [
                (key, *planes.both("GET", f"/alice/split{weight}", headers={**planes.auth(), "X-User": key}))
                for key in keys
            ]
        else:
            from agents import tokens as token_rules

            callers = ("alice", "alice-deploy", "alice-other")
            answers = [
                (
                    token_rules.hash_secret(planes.tokens[who]),
                    *planes.both("GET", f"/alice/split{weight}", headers=planes.auth(who)),
                )
                for who in callers
            ]
        for key, origin, edge in answers:
            alike(origin, edge)
            expected = b"staged" if zlib.crc32(f"{variant}|{key}".encode()) % 100 < weight else b"current"
            assert origin.body == expected, key
            assert not planes.crossed_origin(edge), key
        if by == "header" and weight == 50:
            assert {origin.body for _, origin, _ in answers} == {b"staged", b"current"}  # both drawn
        return edge


for _weight in (0, 50, 100):
    for _by in ("header", "token"):
        split_case(_weight, _by)


@case("forced breaker")
def _(planes):
    origin, edge = planes.both("GET", "/alice/forced", headers=planes.auth())
    alike(origin, edge)
    assert origin.error_code() == "degraded"
    return edge


@case("open breaker")
def _(planes):
    origin, edge = planes.both("GET", "/alice/open", headers=planes.auth())
    # Retry-After is the cool-down's rest, rounded up: a second may tick between the two.
    assert abs(int(edge.headers["retry-after"]) - int(origin.headers["retry-after"])) <= 1
    edge.headers["retry-after"] = origin.headers["retry-after"]
    alike(origin, edge)
    assert origin.error_code() == "degraded"
    return edge


@case("half-open breaker", at="origin")
def _(planes):
    # The trial call runs at the origin, whichever plane it came in by; it succeeds and closes
    # the breaker, so the other plane's call is an ordinary one.
    edge = send(planes.edge, "GET", "/alice/halfopen", headers=planes.auth())
    origin = send(planes.origin, "GET", "/alice/halfopen", headers=planes.auth())
    alike(origin, edge, body=lambda body: body)
    assert (origin.status, origin.body) == (200, b"fine")
    return edge


@case("a capability that throws")
def _(planes):
    origin, edge = planes.both("GET", "/alice/throws?throw", headers=planes.auth())
    alike(origin, edge)
    assert origin.error_code() == "capability_error"
    return edge


@case("an asynchronous call", at="origin")
def _(planes):
    headers = {**planes.auth(), "Prefer": "respond-async", "Content-Type": "text/plain"}
    origin, edge = planes.both("POST", "/alice/public", headers=headers, body=b"later")
    # Each is a call of its own, with its own id and status URL.
    alike(origin, edge, body=lambda body: sorted(json.loads(body)))
    assert origin.status == 202 and origin.headers["preference-applied"] == "respond-async"
    return edge


@case("body within the limit")
def _(planes):
    headers = {**planes.auth(), "Content-Type": "text/plain"}
    origin, edge = planes.both("POST", "/alice/echo", headers=headers, body=b"x" * MAX_BODY)
    alike(origin, edge, body=echoed)
    return edge


@case("body over the limit")
def _(planes):
    origin, edge = planes.both("POST", "/alice/echo", headers=planes.auth(), body=b"x" * (MAX_BODY + 1))
    alike(origin, edge)
    assert origin.status == 413
    return edge


@case("chunked body within the limit")
def _(planes):
    headers = {**planes.auth(), "Content-Type": "text/plain"}
    origin, edge = planes.both("POST", "/alice/echo", headers=headers, body=[b"x" * 20, b"y" * 20], chunked=True)
    alike(origin, edge, body=echoed)
    assert json.loads(origin.body)["body"] == "x" * 20 + "y" * 20
    return edge


@case("chunked body over the limit")
def _(planes):
    chunks = [b"x" * 40, b"y" * 40]
    origin, edge = planes.both("POST", "/alice/echo", headers=planes.auth(), body=chunks, chunked=True)
    alike(origin, edge)
    assert origin.status == 413
    return edge


@case("HEAD")
def _(planes):
    origin, edge = planes.both("HEAD", "/alice/public", headers=planes.auth())
    alike(origin, edge)
    assert (origin.status, origin.body) == (200, b"")
    return edge


@case("HEAD refused")
def _(planes):
    origin, edge = planes.both("HEAD", "/alice/echo", headers=planes.auth("revoked"))
    alike(origin, edge)
    assert (origin.status, origin.body) == (401, b"")
    return edge


ODD_PATHS = {
    "percent-encoded names": "/%61lice/%65cho",
    "percent-encoded rest": "/alice/echo/a%20b/%C3%A9t%C3%A9?q=%2F",
    "encoded slash in the rest": "/alice/echo/a%2Fb",
    "doubled slashes in the rest": "/alice/echo//deep//path",
    "a leading doubled slash": "//alice/echo/x",
    "a doubled slash after the agent": "/alice//echo",
    "dot segments in the rest": "/alice/echo/a/./b/../c",
    "a trailing slash": "/alice/echo/",
    "odd characters in the rest": "/alice/echo/~:@!$&'()*+,;=",
    "a bad percent-encoding in the rest": "/alice/echo/%zz/%4",
    "an encoded NUL in the rest": "/alice/echo/a%00b",
    "an encoded slash in the name": "/alice/echo%2Fx",
    "an upper-case encoded name": "/alice/%45cho",
    "the agent alone": "/alice",
    "the agent and a slash": "/alice/",
    "an empty query": "/alice/echo?",
}


def odd_path_case(what: str, path: str):
    @case(f"odd path: {what}")
    def _(planes):
        headers = {**planes.auth(), "X-Custom": "kept"}
        origin, edge = planes.both("GET", path, headers=headers)
        # The edge as Cloudflare serves it: its workers.dev host named by the Host header.
        by_host = send(planes.emulator.url, "GET", path, headers=headers, host=planes.edge_host)
        how = {"body": echoed} if origin.status == 207 else {}
        alike(origin, edge, **how)
        alike(origin, by_host, **how)
        return edge


for _what, _path in ODD_PATHS.items():
    odd_path_case(_what, _path)


def method_case(method: str, body: bytes | None):
    @case(f"method {method}")
    def _(planes):
        headers = {**planes.auth(), "Content-Type": "text/plain"}
        origin, edge = planes.both(method, "/alice/echo/m", headers=headers, body=body)
        alike(origin, edge, body=echoed)
        assert json.loads(origin.body)["method"] == method
        return edge


for _method, _body in (("OPTIONS", None), ("DELETE", b"gone"), ("PATCH", b"a bit"), ("POST", b"")):
    method_case(_method, _body)


@case("what passes to the capability")
def _(planes):
    headers = {**planes.auth(), "X-Custom": "kept", "X-Sigil-Forged": "1", "Content-Type": "text/plain"}
    origin, edge = planes.both("PUT", "/alice/echo/deep?q=1&r=two", headers=headers, body=b"payload-bytes")
    alike(origin, edge, body=echoed)
    assert json.loads(origin.body)["body"] == "payload-bytes"
    return edge


@case("a streamed answer")
def _(planes):
    def streamed(base: str) -> tuple[Answer, float]:
        parts = urlsplit(base)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        try:
            started = time.monotonic()
            connection.request("GET", parts.path + "/alice/streams", headers=planes.auth())
            response = connection.getresponse()
            first = response.read(len(b"first;"))
            first_at = time.monotonic() - started
            rest = response.read()
            headers = {name.lower(): value for name, value in response.getheaders()}
            return Answer(response.status, headers, first + rest, headers.get("x-request-id")), first_at
        finally:
            connection.close()

    (origin, origin_first), (edge, edge_first) = streamed(planes.origin), streamed(planes.edge)
    alike(origin, edge)
    assert origin.body == b"first;second"
    # Each passed the first chunk on before the capability wrote its second (1.5 s later).
    assert origin_first < 1.0 and edge_first < 1.0
    return edge


def socket_url(base: str, path: str) -> str:
    return base.replace("http://", "ws://") + path


@case("WebSocket echo")
def _(planes):
    from websockets.sync.client import connect

    answers = []
    for base in (planes.origin, planes.edge):
        with connect(socket_url(base, "/alice/ws"), additional_headers=planes.auth(), proxy=None) as session:
            session.send("hello")
            assert session.recv(timeout=10) == "hello"
            session.send(b"\x00\x01binary")
            assert session.recv(timeout=10) == b"\x00\x01binary"
            response = session.response
            headers = {name.lower(): value for name, value in response.headers.raw_items()}
            answers.append(Answer(response.status_code, headers, b"", headers.get("x-request-id")))
    origin, edge = answers
    alike(origin, edge)
    assert origin.status == 101
    return edge


def refused_upgrades(planes, path: str, who: str = "alice") -> tuple[Answer, Answer]:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    answers = []
    for base in (planes.origin, planes.edge):
        with pytest.raises(InvalidStatus) as refused:
            connect(socket_url(base, path), additional_headers=planes.auth(who), proxy=None)
        response = refused.value.response
        headers = {name.lower(): value for name, value in response.headers.raw_items()}
        answers.append(Answer(response.status_code, headers, response.body or b"", headers.get("x-request-id")))
    return answers[0], answers[1]


@case("WebSocket refused by Sigil")
def _(planes):
    origin, edge = refused_upgrades(planes, "/alice/ws", "revoked")
    alike(origin, edge)
    assert origin.error_code() == "unauthenticated"
    return edge


@case("WebSocket refused by the capability")
def _(planes):
    origin, edge = refused_upgrades(planes, "/alice/ws?refuse")
    # Of a bodiless denial's Content-Type, the origin's web server writes its own (uvicorn's
    # text/plain): no part of Sigil's answer.
    origin.headers.pop("content-type", None)
    alike(origin, edge)
    # The capability's status alone, counted as its call's (docs/architecture.md, WebSockets).
    assert (origin.status, origin.body, origin.headers.get("content-length")) == (403, b"", "0")
    return edge


@case("propagation: a revoked token")
def _(planes):
    from agents import services as agent_services
    from agents import tokens as token_rules
    from agents.models import Token

    with planes.publisher.held():
        token = Token.objects.get(secret_hash=token_rules.hash_secret(planes.tokens["late"]))
        agent_services.token_revoke(token=token, actor="owner:test")
        origin, edge = planes.both("GET", "/alice/public", headers=planes.auth("late"))
        # Where the planes differ: the origin refuses at once, the edge serves until published.
        assert origin.status == 401
        assert (edge.status, edge.body) == (200, b"pong") and not planes.crossed_origin(edge)
    edge = planes.at_edge(
        lambda: send(planes.edge, "GET", "/alice/public", headers=planes.auth("late")),
        until=lambda answer: answer.status == 401,
        what="the edge to refuse the revoked token once published",
        timeout=PROPAGATION_BOUND,
    )
    alike(origin, edge)
    return edge


@case("propagation: a forced breaker")
def _(planes):
    from capabilities import services
    from capabilities.models import Capability

    with planes.publisher.held():
        services.capability_force_degraded(
            capability=Capability.objects.get(full_name="alice--late"), actor="owner:test"
        )
        origin, edge = planes.both("GET", "/alice/late", headers=planes.auth())
        # Where the planes differ: the origin refuses at once, the edge serves until published.
        assert origin.error_code() == "degraded"
        assert (edge.status, edge.body) == (200, b"fine") and not planes.crossed_origin(edge)
    edge = planes.at_edge(
        lambda: send(planes.edge, "GET", "/alice/late", headers=planes.auth()),
        until=lambda answer: answer.status == 503,
        what="the edge to refuse the degraded capability once published",
        timeout=PROPAGATION_BOUND,
    )
    alike(origin, edge)
    return edge


@case("propagation: a split's new share")
def _(planes):
    headers = {**planes.auth(), "X-User": "someone"}
    with planes.publisher.held():
        split(planes.deployer, "alice--latesplit", 100)
        origin, edge = planes.both("GET", "/alice/latesplit", headers=headers)
        # Where the planes differ: the origin draws by the new share at once, the edge by the old
        # one until it is published.
        assert origin.body == b"staged"
        assert edge.body == b"current" and not planes.crossed_origin(edge)
    edge = planes.at_edge(
        lambda: send(planes.edge, "GET", "/alice/latesplit", headers=headers),
        until=lambda answer: answer.body == b"staged",
        what="the edge to draw by the split's new share once published",
        timeout=PROPAGATION_BOUND,
    )
    alike(origin, edge)
    return edge


@pytest.mark.parametrize("name", list(CASES))
def test_both_planes_answer_alike(planes, name):
    run, at = CASES[name]
    edge = run(planes)
    if at is not None:
        # Where the edge's answer came from: the edge itself, or the origin it handed the call to.
        assert planes.crossed_origin(edge) == (at == "origin"), f"{name}: expected the {at}'s answer"
