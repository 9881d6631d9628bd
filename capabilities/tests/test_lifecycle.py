"""Lifecycle and alerts: prewarm, inactive marks, and signed webhooks to agents, each
through a real Celery worker where the work is queued."""

import hashlib
import hmac
import json
from datetime import timedelta

import pytest
from django.utils import timezone

from agents.models import Agent, AuditEvent
from capabilities import services
from capabilities.models import Capability
from sigil import redis_keys
from sigil.encryption import secret_encrypt
from sigil.leases import Lease
from testsupport.capability_code import FLAKY
from testsupport.capability_code import answering as code
from testsupport.cast import flush_stats_when_recorded, wait_for


def subscribe(agent_name: str, url: str, secret: str = "shared-with-the-agent") -> str:
    Agent.objects.filter(name=agent_name).update(webhook_url=url, webhook_secret_encrypted=secret_encrypt(secret))
    return secret


def verify(secret: str, headers: dict, body: bytes) -> dict:
    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(headers["x-sigil-signature"], expected)
    return json.loads(body)


def test_prewarm_pages_in_the_most_called_capability(worker_pool, alice, celery_worker):
    alice.deploy(name="hot", code=code("hot"), type="normal")
    alice.deploy(name="warm", code=code("warm"), type="normal")
    for _ in range(5):
        assert alice.call("/alice/hot").text == "hot"
    assert alice.call("/alice/warm").text == "warm"
    flush_stats_when_recorded(alice__hot=5, alice__warm=1)
    services.capability_evict(full="alice--hot", actor="owner:test")
    assert Capability.objects.get(full_name="alice--hot").state == "paged_out"

    # One run at a time: while another holds the run, this one places nothing.
    other_run = Lease(redis_keys.PREWARM_LEASE, hold_seconds=60, blocking=False)
    assert other_run.acquire()
    assert services.capability_prewarm() == []
    assert Capability.objects.get(full_name="alice--hot").state == "paged_out"
    other_run.release()

    assert services.capability_prewarm() == ["alice--hot"]
    assert Capability.objects.get(full_name="alice--hot").state == "live"
    event = AuditEvent.objects.filter(subject="alice--hot", action="capability.paged_in").latest("id")
    assert event.detail["reason"] == "prewarm"
    response = alice.call("/alice/hot")
    assert response.text == "hot" and "X-Sigil-Cold-Start" not in response.headers


@pytest.fixture(params=["worker-pool", "local"])
def three_slots(request, settings):
    """A runtime with a pager of 3 slots (and a margin of 2): the worker pool on the emulator,
    or the local runtime capped by SIGIL_LOCAL_SLOTS."""
    if request.param == "worker-pool":
        request.getfixturevalue("worker_pool")
    else:
        settings.SIGIL_LOCAL_SLOTS = 3
        settings.SIGIL_POOL_SAFETY_MARGIN = 2
    return request.param


def live():
    return set(Capability.objects.filter(state="live").values_list("name", flat=True))


def no_page_out_pending():
    wait_for(lambda: not Capability.objects.filter(state="evicting").exists(), timeout=30, message="page-outs")


def test_prewarm_places_the_hourly_top_n_and_keeps_it_placed(three_slots, alice, celery_worker, settings):
    """The seeds' example: top-N of 3 on 3 slots, calls of 10, 8, 6, 1, 1, 1."""
    settings.SIGIL_PREWARM_TOP_N = 3
    calls = {"f": 1, "a": 10, "b": 8, "c": 6, "d": 1, "e": 1}  # in this order, each paging in
    for name in calls:
        assert alice.deploy(name=name, code=code(name), type="normal").status_code == 201
    for name, count in calls.items():
        for _ in range(count):
            assert alice.call(f"/alice/{name}").text == name
    flush_stats_when_recorded(**{f"alice__{name}": count for name, count in calls.items()})
    no_page_out_pending()
    # The LRU kept the last three called: c (the oldest of them, and of the top 3), d and e.
    assert live() == {"c", "d", "e"}
    page_ins = AuditEvent.objects.filter(action="capability.paged_in").count()

    assert services.capability_prewarm() == ["alice--a", "alice--b"]
    no_page_out_pending()
    assert live() == {"a", "b", "c"}
    # Only what is outside the top 3 was paged out, by prewarm, least recently used first.
    paged_out = AuditEvent.objects.filter(action="capability.evicted", detail__reason="prewarm").order_by("id")
    assert [event.subject for event in paged_out] == ["alice--d", "alice--e"]
    warmed = AuditEvent.objects.filter(action="capability.paged_in", detail__reason="prewarm")
    assert {(event.subject, event.detail["evicted"]) for event in warmed} == {("alice--a", None), ("alice--b", None)}
    assert AuditEvent.objects.filter(action="capability.paged_in").count() == page_ins + 2

    # Again: the top 3 is placed; nothing changes.
    assert services.capability_prewarm() == []
    assert live() == {"a", "b", "c"}
    assert AuditEvent.objects.filter(action="capability.evicted", detail__reason="prewarm").count() == 2


def test_prewarm_fills_free_slots_and_never_trades_one_of_the_top_n_for_another(
    worker_pool, alice, celery_worker, settings
):
    settings.SIGIL_PREWARM_TOP_N = 5  # more than the 3 slots: the top 3 only
    hot = {"h1": 6, "h2": 4, "h3": 2, "h4": 1}
    for name, count in hot.items():
        alice.deploy(name=name, code=code(name), type="normal")
        for _ in range(count):
            assert alice.call(f"/alice/{name}").text == name
    flush_stats_when_recorded(**{f"alice__{name}": count for name, count in hot.items()})
    for name in ("h1", "h2"):
        services.capability_evict(full=f"alice--{name}", actor="owner:test")
    no_page_out_pending()
    assert live() == {"h3", "h4"}  # a slot free

    # h1 takes the free slot; h2 takes h4's, which is not among the top 3; h3 stays.
    assert services.capability_prewarm() == ["alice--h1", "alice--h2"]
    no_page_out_pending()
    assert live() == {"h1", "h2", "h3"}
    paged_out = AuditEvent.objects.filter(action="capability.evicted", detail__reason="prewarm")
    assert [event.subject for event in paged_out] == ["alice--h4"]


def test_prewarm_does_nothing_on_a_runtime_without_a_pager(alice):
    alice.deploy(name="hot", code=code("hot"))
    alice.call("/alice/hot")
    flush_stats_when_recorded(alice__hot=1)
    assert services.capability_prewarm() == []


def test_inactive_mark_fires_for_a_normal_capability_thirty_one_days_old(alice, webhook_receiver, celery_worker):
    secret = subscribe("alice", webhook_receiver.url)
    alice.deploy(name="stale", code=code("stale"), type="normal")
    alice.deploy(name="kept", code=code("kept"), type="persistent")
    alice.call("/alice/stale")
    flush_stats_when_recorded(alice__stale=1)

    assert services.capability_mark_inactive(now=timezone.now() + timedelta(days=29)) == 0
    later = timezone.now() + timedelta(days=31)
    assert services.capability_mark_inactive(now=later) == 1
    assert services.capability_mark_inactive(now=later) == 0  # marked once
    assert Capability.objects.get(full_name="alice--stale").inactive_at is not None
    assert Capability.objects.get(full_name="alice--kept").inactive_at is None
    assert AuditEvent.objects.filter(subject="alice--stale", action="capability.inactive").count() == 1

    wait_for(lambda: webhook_receiver.received, message="the inactive webhook")
    headers, body = webhook_receiver.received[0]
    delivery = verify(secret, headers, body)
    assert delivery["event"] == "capability.inactive" and delivery["capability"] == "alice--stale"

    alice.call("/alice/stale")
    flush_stats_when_recorded(alice__stale=1)
    assert Capability.objects.get(full_name="alice--stale").inactive_at is None  # called again: active


def test_a_signed_alert_reaches_the_agent_when_the_breaker_opens(alice, settings, webhook_receiver, celery_worker):
    settings.SIGIL_BREAKER_THRESHOLD = 3
    secret = subscribe("alice", webhook_receiver.url)
    alice.deploy(name="flaky", code=FLAKY)
    for _ in range(3):
        alice.call("/alice/flaky?fail=1")
    assert alice.call("/alice/flaky").status_code == 503

    wait_for(lambda: webhook_receiver.received, message="the breaker webhook")
    headers, body = webhook_receiver.received[0]
    delivery = verify(secret, headers, body)
    assert headers["x-sigil-event"] == "capability.degraded"
    assert delivery["capability"] == "alice--flaky" and delivery["agent"] == "alice"
    wait_for(
        lambda: AuditEvent.objects.filter(action="webhook.delivered", agent_name="alice").exists(),
        message="the delivery to be audited",
    )


def test_an_error_rate_alert_is_sent_once_per_cooldown(alice, settings, webhook_receiver, celery_worker):
    settings.SIGIL_BREAKER_THRESHOLD = 100  # keep the breaker out of it
    settings.SIGIL_ALERT_MIN_CALLS = 10
    settings.SIGIL_ALERT_ERROR_RATE = 0.5
    secret = subscribe("alice", webhook_receiver.url)
    alice.deploy(name="flaky", code=FLAKY)
    for i in range(10):
        alice.call("/alice/flaky?fail=1" if i % 5 else "/alice/flaky")  # 8 of 10 fail
    flush_stats_when_recorded(alice__flaky=10)
    for _ in range(10):
        alice.call("/alice/flaky?fail=1")
    flush_stats_when_recorded(alice__flaky=10)

    assert AuditEvent.objects.filter(subject="alice--flaky", action="capability.error_rate_alert").count() == 1
    wait_for(lambda: webhook_receiver.received, message="the error-rate webhook")
    delivery = verify(secret, *webhook_receiver.received[0])
    assert delivery["event"] == "capability.error_rate_alert" and delivery["error_rate"] == 0.8


def test_a_webhook_answering_503_is_retried(alice, settings, celery_worker):
    from testsupport.cast import WebhookReceiver

    receiver = WebhookReceiver(fail_first=1)
    try:
        settings.SIGIL_BREAKER_THRESHOLD = 1
        subscribe("alice", receiver.url)
        alice.deploy(name="flaky", code=FLAKY)
        alice.call("/alice/flaky?fail=1")
        wait_for(lambda: receiver.received, timeout=20, message="the retried delivery")
        assert receiver.refused == 1
    finally:
        receiver.stop()


def test_a_webhook_that_never_answers_is_audited_as_failed_after_its_last_retry(alice, settings, celery_worker):
    from testsupport.cast import WebhookReceiver

    receiver = WebhookReceiver(fail_first=100)
    try:
        settings.SIGIL_BREAKER_THRESHOLD = 1
        settings.SIGIL_WEBHOOK_MAX_RETRIES = 1
        subscribe("alice", receiver.url)
        alice.deploy(name="flaky", code=FLAKY)
        alice.call("/alice/flaky?fail=1")
        wait_for(
            lambda: AuditEvent.objects.filter(action="webhook.failed", agent_name="alice").exists(),
            timeout=20,
            message="the failed delivery to be audited",
        )
        assert receiver.refused == 2  # the first try and its one retry
        event = AuditEvent.objects.get(action="webhook.failed")
        assert event.subject == "alice--flaky" and event.detail["event"] == "capability.degraded"
    finally:
        receiver.stop()
