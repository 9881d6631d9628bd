"""Sustained traffic through the edge, then the control plane's work in its usual way: calls
served at the edge (Sigil's Worker in the emulator's workerd, its state as the publisher wrote
it) spend none of the Cloudflare API budget that deploys and page-ins need, whatever travels
back to the origin for them (the edge's reports, and on the platform runtime the calls'
records). Whether a call crossed the origin is read from the origin's access log."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import requests

from capabilities.models import Capability
from capabilities.tests.test_call_logs_runtimes import record_of
from capabilities.tests.test_edge import (
    at_edge,
    crossed_origin,
    edge,  # noqa: F401 (a fixture)
    edge_url,
    publish,
)
from sigil import redis_keys
from testsupport.capability_code import answering
from testsupport.inflight import SERVER_REQUESTS

RATE = 10  # calls a second
SECONDS = 20


@dataclass(frozen=True)
class Answer:
    path: str
    status: int
    text: str
    request_id: str
    retry_after: str | None


def traffic(emulator, agent, paths: list[str]) -> list[Answer]:
    """RATE calls a second for SECONDS through the edge, to each of `paths` in turn, over one
    kept-alive connection, as a steady caller makes them."""
    session = requests.Session()
    auth = agent.headers(agent.invoke_token)
    answers = []
    started = time.monotonic()
    for n in range(RATE * SECONDS):
        path = paths[n % len(paths)]
        answer = session.get(edge_url(emulator, path), headers=auth, timeout=30)
        request_id, retry_after = answer.headers["X-Request-Id"], answer.headers.get("Retry-After")
        answers.append(Answer(path, answer.status_code, answer.text, request_id, retry_after))
        time.sleep(max(0.0, started + (n + 1) / RATE - time.monotonic()))
    session.close()
    return answers


def served_once(access_log, url: str, auth: dict[str, str]) -> None:
    """Once what was published has reached the edge, it serves `url` itself."""
    at_edge(access_log, lambda: requests.get(url, headers=auth, timeout=30), what=f"the edge to serve {url}")


def api_requests(emulator, redis_client) -> tuple[int, int]:
    """The Cloudflare API requests so far: as Sigil counts its own, and as the emulator logged them."""
    return int(redis_client.get(redis_keys.CF_CALLS) or 0), len(emulator.api_calls())


def served_at_the_edge(access_log, answers: list[Answer]) -> None:
    """None of `answers` was served by the origin: no access line of its own names one (the
    edge's reports of them are lines `at_edge`)."""
    for server in SERVER_REQUESTS:
        assert server.wait_idle(timeout=10)
    crossed = {line["request_id"] for line in access_log() if not line["at_edge"]}
    assert [answer.request_id for answer in answers if answer.request_id in crossed] == []


def sustained_traffic_at_the_edge(emulator, alice, access_log, redis_client) -> list:
    """Once alice's a and b are published and served at the edge, the steady traffic to them:
    every answer theirs, none told to wait, all served at the edge, no API request spent
    (by Sigil's count and the emulator's). Returns the answers."""
    publish()
    auth = alice.headers(alice.invoke_token)
    for name in ("a", "b"):
        served_once(access_log, edge_url(emulator, f"/alice/{name}"), auth)
    before = api_requests(emulator, redis_client)
    assert min(before) > 0  # both counted the deploys' requests

    answers = traffic(emulator, alice, ["/alice/a", "/alice/b"])

    assert [(a.status, a.text) for a in answers if (a.status, a.text) != (200, a.path[-1])] == []
    assert not any(answer.retry_after for answer in answers)
    served_at_the_edge(access_log, answers)
    assert api_requests(emulator, redis_client) == before
    return answers


@pytest.mark.parametrize("edge", ["platform"], indirect=True)
def test_sustained_edge_traffic_spends_no_api_request_and_a_deploy_then_is_called_at_once(
    redis_client,  # emptied first: taken before the agent's tokens are marked for the publisher
    edge,  # noqa: F811
    alice,
    access_log,
    settings,
):
    assert settings.SIGIL_LOGS_ENABLED  # the calls' records travel too
    assert alice.deploy(name="a", code=answering("a")).status_code == 201
    assert alice.deploy(name="b", code=answering("b")).status_code == 201
    answers = sustained_traffic_at_the_edge(edge, alice, access_log, redis_client)
    auth = alice.headers(alice.invoke_token)
    for answer in (answers[0], answers[-1]):  # records on: the first and the last call's arrived
        full = f"alice--{answer.path[-1]}"
        assert record_of(alice, full, answer.request_id)["status"] == 200

    deployed = alice.deploy(name="fresh", code=answering("fresh"))
    assert deployed.status_code == 201, deployed.text  # placed, not left placing (202)
    first = requests.get(deployed.json()["url"], headers=auth, timeout=30)
    assert (first.status_code, first.text) == (200, "fresh")  # the origin, until it is published
    assert crossed_origin(access_log, first)


@pytest.mark.parametrize("edge", ["worker-pool"], indirect=True)
def test_sustained_edge_traffic_spends_no_api_request_and_a_deploy_and_a_page_in_then_answer(
    redis_client,  # emptied first: taken before the agent's tokens are marked for the publisher
    edge,  # noqa: F811
    alice,
    access_log,
    celery_worker,
):
    for name in ("a", "b", "c"):  # the pool's three slots
        assert alice.deploy(name=name, code=answering(name), type="normal").status_code == 201
    sustained_traffic_at_the_edge(edge, alice, access_log, redis_client)
    auth = alice.headers(alice.invoke_token)

    # A fourth capability in a full pool: c, the one nobody called, makes room.
    deployed = alice.deploy(name="d", code=answering("d"), type="normal")
    assert deployed.status_code == 201, deployed.text
    first = requests.get(deployed.json()["url"], headers=auth, timeout=30)
    assert (first.status_code, first.text) == (200, "d")
    assert Capability.objects.get(full_name="alice--c").state in ("evicting", "paged_out")

    # c called through the edge: the origin pages it in, and it answers.
    cold = requests.get(edge_url(edge, "/alice/c"), headers=auth, timeout=60)
    assert (cold.status_code, cold.text) == (200, "c")
    assert cold.headers["X-Sigil-Cold-Start"] == "1"
    assert crossed_origin(access_log, cold)
