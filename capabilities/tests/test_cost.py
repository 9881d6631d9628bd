"""The cost estimate: a recorded pattern whose bill is worked out by hand here, the slot
replay on small patterns whose best slot count is known, and the owner's ways to read it."""

import io
import json
from datetime import UTC, datetime, timedelta

import pytest
import requests
from django.core.management import call_command

from agents.models import AuditEvent
from capabilities import cost
from capabilities.books import stats
from capabilities.cost import Access, replay_cold_calls, smallest_slots
from capabilities.models import CapabilityStatsWindow
from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.cast import deploy_answering, wait_for

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
# Latency histograms (stats.LATENCY_BUCKETS_MS): bucket 3 is 5-10 ms, bucket 4 is 10-25 ms.
WITHIN_10_MS, OVER_10_MS = 3, 4


def window(full: str, at: datetime, *, calls: int, duration_ms: float, bucket: int, cold: int = 0) -> None:
    buckets = [0] * (len(stats.LATENCY_BUCKETS_MS) + 1)
    buckets[bucket] = calls
    CapabilityStatsWindow.objects.create(
        full_name=full,
        agent_name=full.split("--")[0],
        window_start=at,
        calls=calls,
        cold_calls=cold,
        latency_ms_sum=duration_ms,
        latency_buckets=buckets,
    )


@pytest.fixture
def recorded(alice, redis_client):
    """Three days of recorded traffic on two capabilities, four page-ins, twelve API calls."""
    deploy_answering(alice, "a", "a")
    deploy_answering(alice, "b", "b")
    day = lambda n: NOW - timedelta(days=n, hours=1)  # noqa: E731
    window("alice--a", day(3), calls=6_000_000, duration_ms=12_000_000, bucket=WITHIN_10_MS, cold=600)
    window("alice--a", day(2), calls=4_000_000, duration_ms=8_000_000, bucket=WITHIN_10_MS)
    window("alice--b", day(2), calls=2_000_000, duration_ms=20_000_000, bucket=OVER_10_MS)
    window("alice--b", day(1), calls=3_000_000, duration_ms=30_000_000, bucket=OVER_10_MS)
    window("alice--b", NOW - timedelta(days=31), calls=9_999_999, duration_ms=1, bucket=0)  # outside the window
    for at in (day(3), day(3), day(3) + timedelta(minutes=5), day(1)):
        AuditEvent.objects.create(actor="system", action="capability.paged_in", subject="alice--a", created_at=at)
    redis_client.set(redis_keys.cf_calls_hour(int(day(3).timestamp() // 3600)), 7)
    redis_client.set(redis_keys.cf_calls_hour(int(day(1).timestamp() // 3600)), 5)


def bills(estimate) -> dict[str, float]:
    return {bill.plan: bill.monthly_usd for bill in estimate.runtimes}


def test_the_estimate_of_a_recorded_month_is_the_bill_worked_out_by_hand(recorded, settings):
    # One script and one Dynamic Worker included, so that the scripts and Dynamic Workers lines show.
    settings.SIGIL_CLOUDFLARE_PRICES = '{"platforms_included_scripts": 1, "dynamic_included_workers": 1}'
    estimate = cost.cost_estimate(now=NOW, days=30)

    # 15 M calls, 70 M ms over 30 days: a month as it is.
    assert estimate.usage.calls == 15_000_000 and estimate.usage.duration_ms == 70_000_000
    assert bills(estimate) == pytest.approx(
        {
            "Workers Free": 0.0,
            # $5 + 5 M requests over 10 M at $0.30/M + 40 M ms over 30 M at $0.02/M
            "Workers Paid": 5 + 1.50 + 0.80,
            # $25 + no requests over 20 M + 10 M ms over 60 M at $0.02/M + 1 script over 1 at $0.02
            "Workers for Platforms": 25 + 0.20 + 0.02,
            # $5 + 30 M requests (two a call) over 10 M at $0.30/M + $0.80 of CPU + 3 Dynamic
            # Worker-days (a on two days, b on two) over 1 at $0.002
            "Dynamic Workers (Workers Paid)": 5 + 6.00 + 0.80 + 3 * 0.002,
        }
    )
    free = estimate.runtimes[0]
    assert not free.fits
    assert free.limits[0] == "the busiest day had 6000000 calls, over 100000 a day"
    assert free.limits[1].startswith("33.3% of calls took over 10 ms")

    pool = estimate.pool
    assert (pool.page_ins, pool.peak_page_ins_per_hour) == (4, 3)
    assert pool.page_ins_per_hour == round(4 / 720, 3)
    assert (pool.cloudflare_api_calls, pool.peak_cloudflare_api_calls_per_hour) == (12, 7)
    assert pool.cloudflare_api_budget_per_hour == 1000 * 3600 / 300
    assert pool.cold_calls == 600 and pool.cold_share == 600 / 15_000_000


def test_what_spent_the_api_budget_is_shown_and_its_kv_operations_billed(recorded, redis_client, settings):
    # Two hours of API calls by class and operation, as the client counts them: keys listed
    # 1.5 M times, 400,000 values read and deleted, 600,000 written (a loader's placements).
    hour = int((NOW - timedelta(days=2)).timestamp() // 3600)
    redis_client.hset(redis_keys.cf_calls_hour_by_class(hour), mapping={"housekeeping": 2_300_000, "page-in": 600_000})
    redis_client.hset(
        redis_keys.cf_calls_hour_by_operation(hour),
        mapping={"kv-list": 1_000_000, "kv-read": 400_000, "kv-delete": 400_000, "kv-write": 600_000},
    )
    redis_client.hset(redis_keys.cf_calls_hour_by_operation(hour + 1), mapping={"kv-list": 500_000, "upload": 2})
    settings.SIGIL_LOGS_ENABLED = True
    estimate = cost.cost_estimate(now=NOW, days=30)

    pool = estimate.pool
    assert pool.cloudflare_api_calls_by_class == {"housekeeping": 2_300_000, "page-in": 600_000}
    assert list(pool.cloudflare_api_calls_by_operation) == ["kv-list", "kv-write", "kv-delete", "kv-read", "upload"]
    usage = estimate.usage
    assert (usage.kv_reads, usage.kv_writes, usage.kv_deletes, usage.kv_lists) == (
        400_000,
        600_000,
        400_000,
        1_500_000,
    )
    # Workers Paid includes 10 M reads, 1 M writes, 1 M deletes, 1 M lists a month: 0.5 M lists
    # over, at $5.00 a million.
    paid = {bill.plan: bill for bill in estimate.runtimes}
    assert paid["Workers Paid"].items["kv"] == pytest.approx(2.50)
    assert paid["Workers Paid"].monthly_usd == pytest.approx(5 + 1.50 + 0.80 + 2.50)
    assert paid["Dynamic Workers (Workers Paid)"].items["kv"] == pytest.approx(2.50)
    assert paid["Workers for Platforms"].items["kv"] == pytest.approx(2.50)
    # Workers Free allows 1,000 writes, deletes and list requests a day, and no Tail Worker.
    free = paid["Workers Free"]
    assert "about 20,000 KV writes a day, over 1,000 a day" in free.limits
    assert "about 50,000 KV list requests a day, over 1,000 a day" in free.limits
    assert "call records come through a Tail Worker, which Workers Free does not offer" in free.limits
    printed = io.StringIO()
    call_command("cost", "--days", "30", stdout=printed)
    assert "Cloudflare API calls by class of work: housekeeping 2300000, page-in 600000" in printed.getvalue()


def test_a_shorter_window_is_scaled_to_a_month(recorded):
    estimate = cost.cost_estimate(now=NOW, days=10)
    assert estimate.usage.calls == 45_000_000  # 15 M in 10 days
    # $5 + 35 M requests over 10 M at $0.30/M + 180 M ms over 30 M at $0.02/M
    assert bills(estimate)["Workers Paid"] == pytest.approx(5 + 10.50 + 3.60)


def accesses(sequence: str, *, types: dict[str, str] | None = None) -> list[Access]:
    types = types or {}
    return [Access(at=float(i), full=name, type=types.get(name, "normal")) for i, name in enumerate(sequence)]


def test_a_cycle_over_three_capabilities_needs_three_slots():
    pattern = accesses("abc" * 100)
    assert replay_cold_calls(pattern, slots=2) == 297  # every call after the first three is cold
    assert replay_cold_calls(pattern, slots=3) == 0
    assert smallest_slots(pattern) == 3


def test_a_rare_third_capability_needs_its_own_slot_only_when_it_is_called_often_enough():
    # a and b alternate; c takes every 50th call. With two slots each c but the first is
    # cold, and each c but the last (which ends the pattern) costs b a page-in after it.
    rare = accesses("".join("c" if i % 50 == 49 else "ab"[i % 2] for i in range(200)))
    assert replay_cold_calls(rare, slots=2) == 3 + 3  # 3 % of 200: too many
    assert smallest_slots(rare) == 3
    rarer = accesses("".join("c" if i % 250 == 249 else "ab"[i % 2] for i in range(1000)))
    assert replay_cold_calls(rarer, slots=2) == 3 + 3  # 0.6 % of 1,000: two slots do
    assert smallest_slots(rarer) == 2


def test_the_replay_evicts_as_the_pager_does_normals_before_persistents():
    # When b arrives, persistent p is the least recently called, yet normal a goes: p is
    # then warm and a cold (a plain LRU would have made both cold).
    pattern = accesses("paaabpa", types={"p": "persistent"})
    assert replay_cold_calls(pattern, slots=2) == 1


def test_calls_through_the_gateway_are_logged_as_the_access_pattern(alice, settings):
    settings.SIGIL_ACCESS_PATTERN_MAX_CALLS = 3
    deploy_answering(alice, "a", "a", type="normal")
    for _ in range(4):
        assert alice.call("/alice/a").status_code == 200
    logged = wait_for(lambda: len(cost.access_log_read()) == 3 and cost.access_log_read(), message="the log")
    assert {(access.full, access.type) for access in logged} == {("alice--a", "normal")}
    assert get_redis().llen(redis_keys.ACCESS_LOG) == 3  # bounded: the oldest call is gone
    pool = cost.cost_estimate(now=datetime.now(UTC) + timedelta(seconds=1), days=1).pool
    assert pool.replayed_calls == 3 and pool.smallest_slots_under_1pct == 1


def test_the_owner_reads_the_estimate_over_http_and_agents_cannot(recorded, alice, sigil, settings):
    settings.SIGIL_OWNER_API_TOKEN = "owner-token-for-tests"
    owner = requests.get(
        f"{sigil.url}/_api/cost?days=30", headers={"Authorization": "Bearer owner-token-for-tests"}, timeout=30
    )
    assert owner.status_code == 200, owner.text
    body = owner.json()
    assert [bill["plan"] for bill in body["runtimes"]] == [
        "Workers Free",
        "Workers Paid",
        "Workers for Platforms",
        "Dynamic Workers (Workers Paid)",
    ]
    assert body["prices"]["paid_monthly_usd"] == 5.0
    refused = alice.call("/_api/cost", token=alice.deploy_token)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    assert requests.get(f"{sigil.url}/_api/cost", timeout=30).status_code == 401
    bad = requests.get(
        f"{sigil.url}/_api/cost?days=0", headers={"Authorization": "Bearer owner-token-for-tests"}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"


def test_manage_py_cost_prints_the_same_estimate_as_json(recorded):
    out = io.StringIO()
    call_command("cost", "--json", "--days", "30", stdout=out)
    printed = json.loads(out.getvalue())
    # The recorded days lie within the last 30 days of today too.
    assert printed["usage"]["calls"] == 15_000_000
    assert printed["runtimes"][1]["monthly_usd"] == pytest.approx(5 + 1.50 + 0.80)


def test_the_dashboard_shows_the_estimate_and_the_admin_session_reads_the_api(recorded, client):
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.create_superuser("owner", "owner@example.invalid", "owner-password")
    client.force_login(user)
    page = client.get("/admin/dashboard/").content.decode()
    assert 'id="cost-estimate"' in page
    assert "Workers for Platforms" in page and "$7.30" in page  # Workers Paid, as worked out above
    answer = client.get("/_api/cost")
    assert answer.status_code == 200 and answer.json()["usage"]["calls"] == 15_000_000
