"""The small cast of agents the tests use, made through Sigil's own services and API."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import requests

from agents import services
from sigil import redis_keys


@dataclass
class AgentClient:
    """An agent with its two tokens, talking to a running Sigil over HTTP."""

    name: str
    deploy_token: str
    invoke_token: str
    base_url: str
    session: requests.Session = field(default_factory=requests.Session)

    def headers(self, token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    def deploy(self, *, token: str | None = "deploy", **body) -> requests.Response:
        token = self.deploy_token if token == "deploy" else self.invoke_token if token == "invoke" else token
        return self.session.post(f"{self.base_url}/_api/deploy", json=body, headers=self.headers(token), timeout=30)

    def call(self, path: str, *, method: str = "GET", token: str | None = "invoke", **kwargs) -> requests.Response:
        token = self.invoke_token if token == "invoke" else self.deploy_token if token == "deploy" else token
        headers = {**self.headers(token), **kwargs.pop("headers", {})}
        return self.session.request(method, f"{self.base_url}{path}", headers=headers, timeout=60, **kwargs)


def make_agent(name: str, base_url: str) -> AgentClient:
    agent = services.agent_create(name=name, actor="owner:test")
    _, deploy = services.token_issue(agent=agent, scope="deploy", actor="owner:test")
    _, invoke = services.token_issue(agent=agent, scope="invoke", actor="owner:test")
    return AgentClient(name, deploy, invoke, base_url)


def grant(binding, *agent_names: str) -> None:
    """The owner grants `binding` (a Binding) to the named agents, as the admin does."""
    from agents.models import Agent
    from capabilities import services as capability_services

    for name in agent_names:
        capability_services.binding_grant(binding=binding, agent=Agent.objects.get(name=name), actor="owner:test")


def wait_for(predicate, *, timeout: float = 10.0, interval: float = 0.05, message: str = "condition"):
    """Poll until `predicate()` is truthy; return its value or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {message}")


class WebhookReceiver:
    """An HTTP server on loopback that records what is posted to it; it can fail the first
    few deliveries with 503 to exercise retries."""

    def __init__(self, *, fail_first: int = 0) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.received: list[tuple[dict[str, str], bytes]] = []
        self.refused = 0
        self.fail_first = fail_first
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if receiver.refused < receiver.fail_first:
                    receiver.refused += 1
                    self.send_response(503)
                else:
                    receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/sigil"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def flush_stats_when_recorded(**expected_calls: int) -> None:
    """Run the stats flush once the engine has recorded the calls a test made.

    The engine records a call after its response is sent, so a test that has just read a
    response may get ahead of it. Keyword names are full names with `__` for `--`.
    """
    from capabilities import tasks
    from sigil.redis_client import get_redis

    redis = get_redis()
    for key, calls in expected_calls.items():
        full = key.replace("__", "--")
        wait_for(
            lambda full=full, calls=calls: int(redis.hget(redis_keys.stats(full), "calls") or 0) >= calls,
            message=f"{calls} calls of {full}",
        )
    tasks.capability_flush_stats()


def deploy_answering(agent, name: str | None, text: str, **body) -> dict:
    """Deploy, as `agent`, code that answers `text`; the deploy must succeed."""
    from testsupport.capability_code import answering

    response = agent.deploy(name=name, code=answering(text), **body)
    assert response.status_code in (200, 201), response.text
    return response.json()


def call_echo_with_everything(agent) -> requests.Response:
    """Deploy, as `agent`, ECHO as `echo` and call it with a method, a deep path, a query,
    headers (one a forged X-Sigil- header) and a body, for what passes through to see."""
    from testsupport.capability_code import ECHO

    agent.deploy(name="echo", code=ECHO)
    return agent.call(
        f"/{agent.name}/echo/deep/path%20x?q=1&r=two",
        method="PUT",
        data=b"payload-bytes",
        headers={"X-Custom": "value", "Content-Type": "text/plain", "X-Sigil-Secret": "forged"},
    )


def fail_flaky(agent, settings, *, threshold: int) -> None:
    """Deploy, as `agent`, FLAKY as `flaky` under a breaker of `threshold` failures and a 1 s
    cool-down, and fail it `threshold` times in a row, each failure passed through unchanged."""
    from testsupport.capability_code import FLAKY

    settings.SIGIL_BREAKER_THRESHOLD = threshold
    settings.SIGIL_BREAKER_COOLDOWN_SECONDS = 1
    agent.deploy(name="flaky", code=FLAKY)
    for _ in range(threshold):
        failed = agent.call(f"/{agent.name}/flaky?fail=1")
        assert (failed.status_code, failed.text) == (500, "broken")
