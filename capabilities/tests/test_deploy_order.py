"""Deploys of one capability are linearizable: the last deploy an agent was told succeeded (or
is pending) is the one that serves, on local (placed in the request, workerd) and on the
worker-pool runtime (placed by a real Celery worker, the emulator's placements slowed down)."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from capabilities.models import CapabilityVersion, VersionPlacement
from testsupport.capability_code import answering as code
from testsupport.cast import wait_for


def nothing_placing() -> bool:
    return not CapabilityVersion.objects.filter(placement=VersionPlacement.PLACING).exists()


def deploy_answers(agent, texts: list[str]) -> list[tuple[str, int, int | None]]:
    """Deploy `texts` at once, one thread each with its own connection: (text, status, version)."""

    def one(text):
        own = dataclasses.replace(agent, session=requests.Session())
        response = own.deploy(name="raced", code=code(text), type="persistent")
        return text, response.status_code, response.json().get("version") if response.ok else None

    with ThreadPoolExecutor(max_workers=len(texts)) as pool:
        return list(pool.map(one, texts))


def test_on_worker_pool_a_deploy_of_the_serving_code_while_another_is_placed_is_no_no_op(worker_pool, alice, settings):
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 0
    assert alice.deploy(name="flip", code=code("x"), type="persistent").status_code == 202
    wait_for(nothing_placing, timeout=30, message="x placed")
    worker_pool.configure(latency=0.4)  # every Cloudflare call: the placement of y is slow

    y = alice.deploy(name="flip", code=code("y"), type="persistent")
    assert (y.status_code, y.json()["version"]) == (202, 2)
    x_again = alice.deploy(name="flip", code=code("x"), type="persistent")
    # Not "200, version 1" from the state before y: a new version, placed after y.
    assert (x_again.status_code, x_again.json()["version"]) == (202, 3), x_again.text
    # The same deploy again while it is still pending is the pending one, not a fourth version.
    same = alice.deploy(name="flip", code=code("x"), type="persistent")
    assert (same.status_code, same.json()["version"]) == (202, 3), same.text

    wait_for(nothing_placing, timeout=60, message="the deploys placed")
    worker_pool.configure(latency=0)
    assert alice.call("/alice/flip").text == "x"
    assert alice.call("/_api/capabilities/alice--flip").json()["version"] == 3


def test_on_worker_pool_racing_deploys_end_with_the_last_one_accepted_serving(worker_pool, alice, settings):
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 0
    assert alice.deploy(name="raced", code=code("start"), type="persistent").status_code == 202
    wait_for(nothing_placing, timeout=30, message="the first version placed")
    worker_pool.configure(latency=0.3)

    answers = deploy_answers(alice, [f"w{i}" for i in range(6)])
    accepted = [(version, text) for text, status, version in answers if status in (200, 201, 202)]
    assert len(accepted) == 6, answers  # each waits its turn to be recorded: none refused
    assert sorted(v for v, _ in accepted) == list(range(2, 8))  # each its own version

    wait_for(nothing_placing, timeout=90, message="the deploys placed or superseded")
    worker_pool.configure(latency=0)
    last_version, last_text = max(accepted)
    assert alice.call("/alice/raced").text == last_text
    assert alice.call("/_api/capabilities/alice--raced").json()["version"] == last_version


def test_on_worker_pool_the_cooldown_applies_to_a_deploy_made_while_another_is_placed(worker_pool, alice, settings):
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 0
    assert alice.deploy(name="cool", code=code("x"), type="persistent").status_code == 202
    wait_for(nothing_placing, timeout=30, message="x placed")
    worker_pool.configure(latency=0.4)
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 60

    assert alice.deploy(name="cool", code=code("y"), type="persistent").status_code == 202
    x_again = alice.deploy(name="cool", code=code("x"), type="persistent")
    assert x_again.status_code == 429, x_again.text  # a real deploy, within the cool-down
    wait_for(nothing_placing, timeout=60, message="y placed")
    worker_pool.configure(latency=0)
    assert alice.call("/alice/cool").text == "y"


@pytest.mark.django_db(transaction=True)
def test_on_local_racing_deploys_wait_their_turn_and_the_last_one_serves(alice):
    assert alice.deploy(name="raced", code=code("start"), type="persistent").status_code == 201

    answers = deploy_answers(alice, [f"l{i}" for i in range(5)] + ["start"])
    assert [status for _, status, _ in answers] == [200] * 6, answers
    # The deploy of the first code again is a no-op only if nothing else was deployed before
    # it; otherwise it is a version of its own.
    accepted = sorted((version, text) for text, _, version in answers)
    last_version, last_text = accepted[-1]
    assert alice.call("/alice/raced").text == last_text
    assert alice.call("/_api/capabilities/alice--raced").json()["version"] == last_version
    placed = CapabilityVersion.objects.filter(capability__full_name="alice--raced").count()
    assert placed == len({v for v, _ in accepted} | {1})
