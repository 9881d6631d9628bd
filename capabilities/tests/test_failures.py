"""Why a capability fails, for its owner: failure records written by the gateway, the
breaker's reason, `X-Request-Id` on every answer, and every answer counted (refusals too)."""

import time

import pytest

from capabilities.books import failures, stats
from capabilities.models import Capability, CapabilityStatsWindow
from capabilities.services import capability_force_degraded
from sigil import redis_keys
from testsupport.capability_code import PONG
from testsupport.cast import flush_stats_when_recorded, wait_for

THROWS = "export default { async fetch() { throw new Error('regressed again\\nsecond line') } }"
FAILS_500 = (
    "export default { async fetch() { return new Response('database is down\\nretry later', { status: 500 }) } }"
)


def inspect(agent, full):
    url = f"{agent.base_url}/_api/capabilities/{full}"
    response = agent.session.get(url, headers=agent.headers(agent.invoke_token))
    assert response.status_code == 200, response.text
    return response.json()


def recorded(full, count):
    return wait_for(lambda: len(failures.failures_list(full=full)) >= count, message=f"{count} failures of {full}")


def test_a_thrown_exception_is_kept_with_its_message_and_request_id_for_the_owner(alice, bob, access_log):
    alice.deploy(name="flaky", code=THROWS, public=True)

    answer = alice.call("/alice/flaky")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "capability_error"
    request_id = answer.headers["X-Request-Id"]
    assert len(request_id) == 16
    recorded("alice--flaky", 1)

    [failure] = inspect(alice, "alice--flaky")["failures"]
    assert failure["request_id"] == request_id
    assert (failure["status"], failure["code"], failure["version"]) == (502, "capability_error", 1)
    assert failure["message"] == "Error: regressed again"
    assert failure["duration_ms"] > 0 and abs(failure["at_epoch"] - time.time()) < 60
    # Another agent may call a public capability, not read why it fails.
    assert inspect(bob, "alice--flaky")["failures"] is None
    assert inspect(bob, "alice--flaky")["breaker_detail"] is None

    [line] = [line for line in access_log() if line["request_id"] == request_id]
    assert (line["capability"], line["status"], line["code"]) == ("alice--flaky", 502, "capability_error")


def test_a_5xx_of_the_capability_is_kept_with_the_first_line_of_its_body(alice):
    alice.deploy(name="down", code=FAILS_500)
    answer = alice.call("/alice/down")
    assert answer.status_code == 500 and answer.text.startswith("database is down")
    recorded("alice--down", 1)
    [failure] = failures.failures_list(full="alice--down")
    assert (failure.status, failure.code, failure.message) == (500, None, "database is down")
    assert failure.request_id == answer.headers["X-Request-Id"]


def test_failure_records_are_capped_newest_first(alice, settings):
    settings.SIGIL_BREAKER_THRESHOLD = 100
    settings.SIGIL_FAILURES_KEPT = 3
    alice.deploy(name="flaky", code=THROWS)
    ids = [alice.call("/alice/flaky").headers["X-Request-Id"] for _ in range(5)]
    wait_for(lambda: failures.failures_list(full="alice--flaky")[0].request_id == ids[-1], message="the last failure")
    assert [f.request_id for f in failures.failures_list(full="alice--flaky")] == ids[:1:-1]


def test_the_breaker_says_which_failures_tripped_it_and_until_when(alice, settings):
    settings.SIGIL_BREAKER_THRESHOLD = 3
    alice.deploy(name="flaky", code=THROWS)
    ids = [alice.call("/alice/flaky").headers["X-Request-Id"] for _ in range(3)]
    wait_for(lambda: alice.call("/alice/flaky").status_code == 503, message="the breaker to open")

    detail = inspect(alice, "alice--flaky")["breaker_detail"]
    assert detail["state"] == "open" and detail["forced_by"] is None
    assert set(detail["tripped_by"]) == set(ids)
    assert detail["until"] - detail["opened_at"] == pytest.approx(settings.SIGIL_BREAKER_COOLDOWN_SECONDS, abs=0.01)


def test_a_forced_breaker_names_who_forced_it(alice):
    alice.deploy(name="ping", code=PONG)
    capability = Capability.objects.get(full_name="alice--ping")
    capability_force_degraded(capability=capability, actor="owner:root")

    detail = inspect(alice, "alice--ping")["breaker_detail"]
    assert (detail["state"], detail["forced_by"], detail["until"]) == ("forced", "owner:root", None)
    assert detail["forced_at"] is not None


def test_every_answer_carries_a_request_id_and_is_logged_with_it(alice, access_log):
    alice.deploy(name="ping", code=PONG)
    answers = [alice.call("/alice/ping"), alice.call("/alice/nothing-here"), alice.call("/alice/ping", token=None)]
    ids = [a.headers["X-Request-Id"] for a in answers]
    assert len(set(ids)) == 3
    logged = {line["request_id"]: line for line in access_log()}
    assert logged[ids[0]]["code"] is None and logged[ids[0]]["capability"] == "alice--ping"
    assert logged[ids[1]]["code"] == "not_found" and logged[ids[1]]["capability"] is None
    assert logged[ids[2]]["code"] == "unauthenticated"
    # The control API's answers carry one too.
    assert len(alice.session.get(f"{alice.base_url}/_health").headers["X-Request-Id"]) == 16


def test_refusals_are_counted_per_capability_and_in_total(alice, access_log):
    alice.deploy(name="ping", code=PONG)
    assert alice.call("/alice/ping").status_code == 200
    capability_force_degraded(capability=Capability.objects.get(full_name="alice--ping"), actor="owner:root")
    for _ in range(3):
        refused = alice.call("/alice/ping")
        assert refused.status_code == 503
    assert alice.call("/alice/nothing-here").status_code == 404
    # A degraded capability's refusals name it in the access log, with their code.
    degraded = [line for line in access_log() if line["code"] == "degraded"]
    assert len(degraded) == 3 and {line["capability"] for line in degraded} == {"alice--ping"}
    wait_for(lambda: int(get_field("-", "refused")) >= 1, message="the 404 counted")
    flush_stats_when_recorded(alice__ping=1)

    capability = Capability.objects.get(full_name="alice--ping")
    assert (capability.calls_total, capability.errors_total, capability.refused_total) == (1, 0, 3)
    assert capability.statuses_total == {"2xx": 1, "5xx": 3}
    assert capability.codes_total == {"degraded": 3}
    unrouted = CapabilityStatsWindow.objects.get(full_name=stats.UNROUTED)
    assert (unrouted.refused, unrouted.codes) == (1, {"not_found": 1})
    assert stats.unrouted_totals() == ({"4xx": 1}, {"not_found": 1})


def get_field(full, field):
    from sigil.redis_client import get_redis

    return get_redis().hget(redis_keys.stats(full), field) or 0


def test_removing_a_capability_forgets_its_failures(alice):
    alice.deploy(name="flaky", code=THROWS)
    alice.call("/alice/flaky")
    recorded("alice--flaky", 1)
    url = f"{alice.base_url}/_api/capabilities/alice--flaky"
    assert alice.session.delete(url, headers=alice.headers(alice.deploy_token)).status_code == 204
    assert failures.failures_list(full="alice--flaky") == []
