"""The owner's dashboard and beat schedule pages, and the admin's safety settings."""

import pytest
from django.contrib.auth import get_user_model

from capabilities import tasks
from sigil import charts, redis_keys
from sigil.redis_client import get_redis
from sigil_site.beat import beat_record_run, beat_schedule_list
from testsupport.cast import flush_stats_when_recorded, wait_for

PAGES = ["/admin/dashboard/", "/admin/beat-schedule/"]


@pytest.fixture
def owner_client(client, db):
    user = get_user_model().objects.create_superuser("owner", "owner@example.invalid", "owner-password")
    client.force_login(user)
    return client


@pytest.mark.django_db
@pytest.mark.parametrize("page", PAGES)
def test_owner_pages_are_for_staff_only(client, page):
    assert client.get(page).status_code == 302  # to the login page
    user = get_user_model().objects.create_user("agent-runner", password="x")
    client.force_login(user)
    response = client.get(page)
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")


@pytest.mark.parametrize("page", PAGES)
def test_owner_pages_render_for_the_owner_and_are_linked_from_the_index(owner_client, page):
    assert owner_client.get(page).status_code == 200
    assert f'href="{page}"' in owner_client.get("/admin/").content.decode()


def test_dashboard_counts_flushed_calls_errors_and_cold_share(sigil, alice, client):
    user = get_user_model().objects.create_superuser("owner", "owner@example.invalid", "owner-password")
    client.force_login(user)
    flaky = (
        "export default { async fetch(request) {"
        " return new URL(request.url).searchParams.has('fail')"
        " ? new Response('no', { status: 500 }) : new Response('ok')"
        " } }"
    )
    alice.deploy(name="flaky", code=flaky)
    for query in ("", "", "", "?fail"):
        alice.call(f"/alice/flaky{query}")
    flush_stats_when_recorded(alice__flaky=4)

    response = client.get("/admin/dashboard/?span=6h")
    data = response.context["data"]
    assert (data.total.calls, data.total.errors) == (4, 1)
    assert sum(b.calls for b in data.buckets) == 4 and len(data.buckets) == 36
    assert data.top[0].full_name == "alice--flaky" and data.total.p95_ms is not None
    assert response.context["status"]["used_slots"] == 1
    body = response.content.decode()
    assert body.count("<svg") >= 5 and "errors / calls" in body


def test_beat_page_lists_every_scheduled_task_and_when_a_worker_last_ran_it(owner_client, settings, celery_worker):
    get_redis().delete(redis_keys.BEAT_LAST_RUN)
    tasks.capability_flush_stats.delay()
    wait_for(
        lambda: get_redis().hexists(redis_keys.BEAT_LAST_RUN, "capabilities.capability_flush_stats"), message="a run"
    )

    entries = {e.name: e for e in beat_schedule_list()}
    assert set(entries) == set(settings.CELERY_BEAT_SCHEDULE)
    flush = entries["capability-flush-stats"]
    assert flush.last_ok is True and flush.next_due_at > flush.last_run_at
    assert entries["capability-prewarm"].last_run_at is None
    body = owner_client.get("/admin/beat-schedule/").content.decode()
    assert "capabilities.capability_flush_stats" in body and "every 10 s" in body and "succeeded" in body


@pytest.mark.django_db
def test_only_scheduled_tasks_are_recorded_and_a_failure_is_kept():
    get_redis().delete(redis_keys.BEAT_LAST_RUN)
    beat_record_run(task="capabilities.capability_page_in", ok=True, at_epoch=1.0)
    beat_record_run(task="capabilities.capability_reconcile", ok=False, at_epoch=2.0, error="RuntimeUnavailable()")
    assert get_redis().hkeys(redis_keys.BEAT_LAST_RUN) == [b"capabilities.capability_reconcile"]
    reconcile = next(e for e in beat_schedule_list() if e.task == "capabilities.capability_reconcile")
    assert reconcile.last_ok is False and reconcile.last_error == "RuntimeUnavailable()"
    assert reconcile.schedule == "every 5 minutes"


def test_chart_labels_are_escaped_and_axes_are_round():
    svg = charts.time_chart(
        title="<b>calls</b>", x_labels=["<i>"], series=[charts.Series("<script>", [7], "calls")], kind="bars"
    )
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "&lt;b&gt;" in svg
    assert [charts.nice_ceiling(v) for v in (0, 7, 12, 0.03, 240)] == [1, 10, 20, 0.05, 250]


@pytest.mark.django_db
def test_admin_pages_refuse_framing_and_sniffing(client):
    response = client.get("/admin/login/")
    assert response["X-Frame-Options"] == "DENY"
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["Referrer-Policy"] == "same-origin"


def test_dashboard_filters_by_agent_counts_refusals_and_explains_what_does_not_apply(sigil, alice, bob, client):
    user = get_user_model().objects.create_superuser("owner", "owner@example.invalid", "owner-password")
    client.force_login(user)
    alice.deploy(name="ping", code="export default { async fetch() { return new Response('a') } }")
    bob.deploy(name="ping", code="export default { async fetch() { return new Response('b') } }")
    for _ in range(2):
        alice.call("/alice/ping")
    bob.call("/bob/ping")
    assert alice.call("/alice/ping", token=None).status_code == 401  # counted on the capability
    flush_stats_when_recorded(alice__ping=2, bob__ping=1)

    everyone = client.get("/admin/dashboard/").context
    assert (everyone["total"].calls, everyone["total"].refused) == (3, 1)
    assert everyone["total"].statuses == {"2xx": 3, "4xx": 1}
    assert everyone["total"].codes == {"unauthenticated": 1}
    only_bob = client.get("/admin/dashboard/?agent=bob")
    assert (only_bob.context["total"].calls, only_bob.context["total"].refused) == (1, 0)
    assert [c.full_name for c in only_bob.context["data"].top] == ["bob--ping"]
    assert client.get("/admin/dashboard/?agent=nobody").context["agent"] is None  # unknown: everyone

    # Three calls are too few for an error rate; the local runtime pages nothing.
    assert everyone["total_error_rate"] is None
    body = client.get("/admin/dashboard/").content.decode()
    assert (
        'http-equiv="refresh"' in body
        and 'id="paging-note"' in body
        and "Page-ins and evictions</figcaption><svg" not in body
    )
    assert 'http-equiv="refresh"' not in client.get("/admin/dashboard/?refresh=off").content.decode()
