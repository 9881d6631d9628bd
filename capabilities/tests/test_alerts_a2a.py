"""Alerts in the agents' own protocol: an agent that gives its A2A Agent Card's URL receives
its alerts as A2A messages, sent with the official SDK, retried and audited as webhooks are;
tested against an A2A agent built with the same SDK, on loopback, through a real Celery worker."""

import pytest

from agents import services as agent_services
from agents.models import Agent, AuditEvent
from capabilities.tests.test_lifecycle import FLAKY
from testsupport.a2a_agent import A2aAgent
from testsupport.cast import flush_stats_when_recorded, wait_for


@pytest.fixture
def a2a_agent():
    agent = A2aAgent()
    yield agent
    agent.stop()


def listen(agent_name: str, card_url: str) -> None:
    agent = Agent.objects.get(name=agent_name)
    agent_services.agent_set_a2a(agent=agent, url=card_url, actor="owner:test")


def test_an_error_spike_reaches_the_agents_a2a_endpoint_as_a_message_with_its_request_ids(
    alice, settings, a2a_agent, celery_worker
):
    settings.SIGIL_BREAKER_THRESHOLD = 100  # keep the breaker out of it
    settings.SIGIL_ALERT_MIN_CALLS = 10
    settings.SIGIL_ALERT_ERROR_RATE = 0.5
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = ["127.0.0.0/8"]  # the test agent is on loopback
    listen("alice", a2a_agent.card_url)
    alice.deploy(name="flaky", code=FLAKY)
    failed = []
    for i in range(10):
        answer = alice.call("/alice/flaky?fail=1" if i % 5 else "/alice/flaky")  # 8 of 10 fail
        if answer.status_code == 500:
            failed.append(answer.headers["X-Request-Id"])
    flush_stats_when_recorded(alice__flaky=10)

    [message] = wait_for(lambda: a2a_agent.received, timeout=20, message="the A2A message")
    [data] = message["data"]
    assert data["event"] == "capability.error_rate_alert" and data["capability"] == "alice--flaky"
    assert data["error_rate"] == 0.8 and data["agent"] == "alice"
    assert data["request_ids"] == list(reversed(failed))[:5]  # its latest failures, newest first
    assert data["logs"].endswith("/_api/capabilities/alice--flaky/logs?level=error")
    assert message["message_id"] == data["id"]  # the delivery's id: a retry is recognisable
    assert message["text"].startswith("Sigil: alice--flaky errors spiked. Request ids: ")
    delivered = wait_for(
        lambda: AuditEvent.objects.filter(action="a2a.delivered", agent_name="alice").first(),
        message="the A2A delivery to be audited",
    )
    assert delivered.subject == "alice--flaky" and delivered.detail["delivery"] == data["id"]


def test_an_a2a_endpoint_answering_503_is_retried_and_one_that_never_answers_is_audited_as_failed(
    alice, settings, celery_worker
):
    settings.SIGIL_BREAKER_THRESHOLD = 1
    settings.SIGIL_WEBHOOK_MAX_RETRIES = 1
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    busy_once, always_busy = A2aAgent(fail_first=1), A2aAgent(fail_first=100)
    try:
        listen("alice", busy_once.card_url)
        alice.deploy(name="flaky", code=FLAKY)
        alice.call("/alice/flaky?fail=1")  # the breaker opens: capability.degraded
        [message] = wait_for(lambda: busy_once.received, timeout=20, message="the retried A2A message")
        assert busy_once.refused == 1 and message["data"][0]["event"] == "capability.degraded"

        listen("alice", always_busy.card_url)
        alice.deploy(name="flaky2", code=FLAKY)
        alice.call("/alice/flaky2?fail=1")
        failed = wait_for(
            lambda: AuditEvent.objects.filter(action="a2a.failed", subject="alice--flaky2").first(),
            timeout=20,
            message="the failed A2A delivery to be audited",
        )
        assert always_busy.refused == 2 and failed.detail["event"] == "capability.degraded"  # a try and a retry
        assert "503" in failed.detail["reason"]
    finally:
        busy_once.stop()
        always_busy.stop()


def test_an_agent_sets_its_agent_card_url_over_the_api_public_addresses_only(alice, bob, settings):
    url = f"{alice.base_url}/_api/agent/a2a"
    assert alice.session.get(url, headers=alice.headers(alice.invoke_token)).json() == {
        "agent": "alice",
        "agent_card_url": "",
    }
    body = {"agent_card_url": "http://127.0.0.1:9/.well-known/agent-card.json"}
    assert alice.session.put(url, json=body, headers=alice.headers(alice.invoke_token)).status_code == 403
    refused = alice.session.put(url, json=body, headers=alice.headers(alice.deploy_token))
    assert refused.status_code == 400 and "private or reserved address" in refused.json()["error"]["message"]

    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    accepted = alice.session.put(url, json=body, headers=alice.headers(alice.deploy_token))
    assert accepted.status_code == 200 and accepted.json()["agent_card_url"] == body["agent_card_url"]
    assert Agent.objects.get(name="alice").a2a_card_url == body["agent_card_url"]
    assert Agent.objects.get(name="bob").a2a_card_url == ""
    assert AuditEvent.objects.filter(action="agent.a2a_changed", actor="agent:alice").count() == 1
    cleared = alice.session.put(url, json={"agent_card_url": ""}, headers=alice.headers(alice.deploy_token))
    assert cleared.json()["agent_card_url"] == ""
