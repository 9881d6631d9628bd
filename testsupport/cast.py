"""The small cast of agents the tests use, made through Sigil's own services and API."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import requests

from agents import services


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


def wait_for(predicate, *, timeout: float = 10.0, interval: float = 0.05, message: str = "condition"):
    """Poll until `predicate()` is truthy; return its value or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {message}")
