"""The owner's services behind the admin's buttons: rollback, force degraded, public flag."""

import pytest

from agents.models import AuditEvent
from capabilities import services
from capabilities.models import Capability
from sigil import redis_keys
from sigil.errors import NotFound
from sigil.redis_client import get_redis
from testsupport.capability_code import answering as code
from testsupport.cast import wait_for


@pytest.fixture(params=["local", "worker-pool"])
def runtime(request, alice):
    """The local runtime places a rollback in the request; the worker pool, under the
    emulator, in the deploy task, as it places deploys."""
    if request.param == "worker-pool":
        request.getfixturevalue("worker_pool")
    return request.param


def test_rollback_deploys_the_old_code_as_a_new_version_and_serves_it(runtime, alice):
    alice.deploy(name="greet", code=code("one"))
    alice.deploy(name="greet", code=code("two"))
    capability = Capability.objects.get(full_name="alice--greet")

    result = services.capability_rollback(capability=capability, version_number=1, actor="owner:test")

    assert result.version.number == 3
    assert result.version.sha == capability.versions.get(number=1).sha
    assert alice.call("/alice/greet").text == "one"
    event = AuditEvent.objects.get(action="capability.rolled_back", subject="alice--greet")
    assert event.actor == "owner:test" and event.detail["restored_version"] == 1 and event.detail["version"] == 3
    inspected = alice.session.get(
        f"{alice.base_url}/_api/capabilities/alice--greet", headers=alice.headers(alice.invoke_token), timeout=10
    ).json()
    assert inspected["version"] == 3


def test_on_the_pool_the_owners_rollback_is_placed_by_the_deploy_worker(worker_pool, alice, admin_client, settings):
    alice.deploy(name="greet", code=code("one"))
    alice.deploy(name="greet", code=code("two"))
    capability = Capability.objects.get(full_name="alice--greet")
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 0  # the page answers before the placement is done
    page = admin_client.post(f"/admin/capabilities/capability/{capability.pk}/rollback/", {"version": 1}, follow=True)
    assert "The code of v1 is being placed as v3" in page.content.decode()
    wait_for(lambda: alice.call("/alice/greet").text == "one", timeout=30, message="v3 placed and served")
    event = AuditEvent.objects.get(action="capability.rolled_back", subject="alice--greet")
    assert event.actor.startswith("owner:") and event.detail["restored_version"] == 1 and event.detail["version"] == 3
    assert capability.versions.get(number=3).placement == "placed"


def test_rollback_to_the_code_being_served_makes_no_new_version(alice):
    alice.deploy(name="greet", code=code("one"))
    alice.deploy(name="greet", code=code("two"))
    alice.deploy(name="greet", code=code("one"))
    capability = Capability.objects.get(full_name="alice--greet")

    result = services.capability_rollback(capability=capability, version_number=1, actor="owner:test")

    assert result.version.number == 3 and capability.versions.count() == 3
    assert not AuditEvent.objects.filter(action="capability.rolled_back").exists()


def test_rollback_to_a_missing_version_or_of_a_removed_capability_is_not_found(alice):
    alice.deploy(name="greet", code=code("one"))
    alice.deploy(name="greet", code=code("two"))
    capability = Capability.objects.get(full_name="alice--greet")
    with pytest.raises(NotFound):
        services.capability_rollback(capability=capability, version_number=9, actor="owner:test")
    services.capability_remove_as_owner(full="alice--greet", actor="owner:test")
    with pytest.raises(NotFound):
        services.capability_rollback(capability=capability, version_number=1, actor="owner:test")


def test_forced_degraded_answers_503_with_a_finite_retry_after_until_the_owner_resets(alice, settings):
    settings.SIGIL_BREAKER_COOLDOWN_SECONDS = 30
    alice.deploy(name="ping", code=code("pong"))
    capability = Capability.objects.get(full_name="alice--ping")

    services.capability_force_degraded(capability=capability, actor="owner:test")
    services.capability_force_degraded(capability=capability, actor="owner:test")  # idempotent

    for _ in range(3):
        refused = alice.call("/alice/ping")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "degraded"
        assert refused.headers["Retry-After"] == "30"
    capability.refresh_from_db()
    assert capability.breaker_state == "open" and capability.breaker_opened_at is not None
    assert AuditEvent.objects.filter(action="capability.forced_degraded", subject="alice--ping").count() == 2

    services.capability_reset_breaker(capability=capability, actor="owner:test")
    assert alice.call("/alice/ping").text == "pong"
    assert get_redis().get(redis_keys.breaker_open("alice--ping")) is None
    capability.refresh_from_db()
    assert capability.breaker_state == "closed"


def test_calls_in_flight_when_forced_degraded_neither_close_nor_shorten_it(alice, settings):
    import threading
    import time

    settings.SIGIL_BREAKER_COOLDOWN_SECONDS = 30
    slow = """export default { async fetch(request) {
        await new Promise((resolve) => setTimeout(resolve, 1500))
        return new Response('done', { status: new URL(request.url).searchParams.get('status') || 200 })
    } }"""
    alice.deploy(name="slow", code=slow)
    capability = Capability.objects.get(full_name="alice--slow")
    answers = {}
    calls = [
        threading.Thread(
            target=lambda status=status: answers.__setitem__(status, alice.call(f"/alice/slow?status={status}"))
        )
        for status in (200, 500)
    ]
    for call in calls:
        call.start()
    time.sleep(0.5)  # both are inside the capability now
    services.capability_force_degraded(capability=capability, actor="owner:test")
    for call in calls:
        call.join(timeout=10)

    assert answers[200].status_code == 200 and answers[500].status_code == 500
    refused = alice.call("/alice/slow")
    assert refused.status_code == 503 and "owner" in refused.json()["error"]["message"]
    capability.refresh_from_db()
    assert capability.breaker_state == "open"


def test_public_flag_decides_whether_another_agent_may_call(alice, bob):
    alice.deploy(name="shared", code=code("hi"))
    capability = Capability.objects.get(full_name="alice--shared")
    assert bob.call("/alice/shared").status_code == 404

    assert services.capability_set_public(capability=capability, is_public=True, actor="owner:test") is True
    assert services.capability_set_public(capability=capability, is_public=True, actor="owner:test") is False
    assert bob.call("/alice/shared").text == "hi"

    services.capability_set_public(capability=capability, is_public=False, actor="owner:test")
    assert bob.call("/alice/shared").status_code == 404
    assert AuditEvent.objects.filter(action="capability.updated", subject="alice--shared").count() == 2
