"""The LRU pager on a runtime with a slot limit (the local runtime capped at a few slots):
eviction order, page-in on demand, background page-out, and reconcile."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agents.models import AuditEvent
from capabilities import services
from capabilities.books import pager, routes
from capabilities.models import Capability
from capabilities.runtimes import get_runtime
from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.capability_code import answering as code
from testsupport.cast import deploy_answering as deploy
from testsupport.cast import wait_for

# What reconcile's reaper reports when no process died.
NOTHING_REAPED = {"deploys_resent": 0, "deploys_failed": 0, "placing_freed": 0, "page_outs_resent": 0}


@pytest.fixture
def capped(settings):
    settings.SIGIL_LOCAL_SLOTS = 3
    settings.SIGIL_POOL_SAFETY_MARGIN = 2
    return settings


def state(full):
    return Capability.objects.get(full_name=full).state


def test_eviction_follows_the_seed_order(capped, alice, celery_worker):
    deploy(alice, "keep", "p", type="persistent")
    deploy(alice, "norm", "n", type="normal")
    ephemeral = deploy(alice, None, "e", type="ephemeral")["capability"]
    time.sleep(0.01)
    for path in ("/alice/norm", "/alice/keep"):
        assert alice.call(path).status_code == 200

    # Full: the ephemeral goes first even though it is not the least recently used.
    first = deploy(alice, "norm2", "n2", type="normal")
    assert first["cold_start"] is True and first["evicted"] == ephemeral
    # Then the least recently used normal, before any persistent.
    second = deploy(alice, "norm3", "n3", type="normal")
    assert second["evicted"] == "alice--norm"
    third = deploy(alice, "norm4", "n4", type="normal")
    assert third["evicted"] == "alice--norm2"

    wait_for(lambda: state("alice--norm2") == "paged_out", message="background page-out")
    assert state("alice--keep") == "live"
    assert len(get_runtime().list_slots()) <= 3 + 2
    evicted = set(AuditEvent.objects.filter(action="capability.evicted").values_list("subject", flat=True))
    assert evicted == {ephemeral, "alice--norm", "alice--norm2"}


def test_expired_ephemerals_are_evicted_before_live_ones(capped, alice, celery_worker):
    old = deploy(alice, None, "old", ttl=3600)["capability"]
    expiring = deploy(alice, None, "expiring", ttl=1)["capability"]
    deploy(alice, "keep", "p")
    assert alice.call("/" + old.replace("--", "/")).status_code == 200  # the older access is not what counts
    time.sleep(1.1)
    assert deploy(alice, "next", "x")["evicted"] == expiring


def test_an_evicted_capability_pages_back_in_on_its_next_call(capped, alice, celery_worker):
    for name in ("a", "b", "c"):
        deploy(alice, name, name, type="normal")
    assert deploy(alice, "d", "d", type="normal")["evicted"] == "alice--a"
    wait_for(lambda: state("alice--a") == "paged_out", message="a paged out")

    response = alice.call("/alice/a")
    assert response.status_code == 200 and response.text == "a"
    assert response.headers["X-Sigil-Cold-Start"] == "1"
    assert "page-in;dur=" in response.headers["Server-Timing"]
    assert state("alice--a") == "live"
    assert alice.call("/alice/a").headers.get("X-Sigil-Cold-Start") is None
    assert Capability.objects.get(full_name="alice--a").slot == "alice--a"


def test_a_victim_is_routed_away_before_its_script_is_deleted(capped, alice, celery_worker):
    # The page-out sends new calls to page it in, then waits for the one in flight.
    in_flight = evict_a_with_a_call_in_flight(alice)
    assert state("alice--a") == "evicting" and "alice--a" in get_runtime().list_slots()
    assert alice.call("/alice/a").text == "a"  # to page it in, which finds it still placed
    assert not AuditEvent.objects.filter(action="capability.paged_in", subject="alice--a").exists()

    pager.pager_inflight_leave("alice--a", process=in_flight)  # the call in flight ends
    wait_for(lambda: state("alice--a") == "paged_out", message="a paged out")
    # The gateway knew before the registry did: the next call pages it in.
    assert route_state("alice--a") == "paged_out"
    assert "alice--a" not in get_runtime().list_slots()
    assert alice.call("/alice/a").headers["X-Sigil-Cold-Start"] == "1"


def route_state(full):
    return routes.decode(get_redis().get(redis_keys.route(full))).state


def evict_a_with_a_call_in_flight(alice) -> str:
    """Normals a, b and c fill the capped room; with a call to a in flight, d's deploy evicts
    a, whose route turns away from it while its page-out waits for that call. Returns what
    pager_inflight_leave takes to end that call."""
    for name in ("a", "b", "c"):
        deploy(alice, name, name, type="normal")
    in_flight = pager.pager_inflight_enter("alice--a")  # a call to it is in flight in this process
    assert deploy(alice, "d", "d", type="normal")["evicted"] == "alice--a"
    wait_for(lambda: route_state("alice--a") == "paged_out", message="the route to turn away from it")
    return in_flight


def test_a_write_of_a_victim_waiting_for_its_calls_keeps_new_calls_away_from_it(capped, alice, celery_worker):
    in_flight = evict_a_with_a_call_in_flight(alice)

    # The owner makes the victim public while its page-out waits: its copies are published
    # again from its row (still evicting), and its route stays turned away.
    victim = Capability.objects.get(full_name="alice--a")
    assert services.capability_set_public(capability=victim, is_public=True, actor="owner:test")
    route = routes.decode(get_redis().get(redis_keys.route("alice--a")))
    assert (state("alice--a"), route.state, route.is_public) == ("evicting", "paged_out", True)

    pager.pager_inflight_leave("alice--a", process=in_flight)  # the call in flight ends
    wait_for(lambda: state("alice--a") == "paged_out", message="a paged out")
    assert alice.call("/alice/a").headers["X-Sigil-Cold-Start"] == "1"


def test_a_burst_on_one_cold_capability_places_it_once(capped, alice, celery_worker):
    for name in ("a", "b", "c", "d"):
        deploy(alice, name, name, type="normal")
    wait_for(lambda: state("alice--a") == "paged_out", message="a paged out")

    def call(_):
        response = alice.call("/alice/a", token=alice.invoke_token)
        return response.status_code, response.text

    with ThreadPoolExecutor(max_workers=25) as pool:
        results = list(pool.map(call, range(50)))
    assert results == [(200, "a")] * 50
    assert AuditEvent.objects.filter(action="capability.paged_in", subject="alice--a").count() == 1


def test_respond_async_gets_202_and_the_result_once_paged_in(capped, alice, celery_worker):
    for name in ("a", "b", "c", "d"):
        deploy(alice, name, name, type="normal")
    wait_for(lambda: state("alice--a") == "paged_out", message="a paged out")

    accepted = alice.call("/alice/a", headers={"Prefer": "respond-async"})
    assert accepted.status_code == 202
    status_url = accepted.json()["status_url"]
    result = wait_for(lambda: (r := alice.call(status_url)).status_code == 200 and r, message="the call's result")
    assert result.text == "a" and result.headers["X-Sigil-Cold-Start"] == "1"
    assert alice.call("/_status/alice--a").json()["status"] == "ready"


def test_status_reports_slots_and_evictions(capped, alice, celery_worker):
    for name in ("a", "b", "c", "d"):
        deploy(alice, name, name, type="normal")
    wait_for(lambda: state("alice--a") == "paged_out", message="a paged out")
    status = alice.call("/_api/status").json()
    assert status["total_slots"] == 3 and status["lru_enabled"] is True
    assert status["used_slots"] == 3 and status["eviction_count"] == 1


def test_reconcile_removes_orphans_and_repairs_lost_placements(capped, alice):
    from capabilities.runtimes.base import CodeBundle

    deploy(alice, "a", "a")
    deploy(alice, "b", "b")
    runtime = get_runtime()
    runtime.place(slot="alice--ghost", tenant="alice", bundle=CodeBundle.from_code(code("ghost")))  # nobody's
    runtime.remove(slot="alice--b")  # lost behind Sigil's back

    result = services.capability_reconcile()
    assert result["orphans_removed"] == 1 and result["repaired"] == 1
    assert set(runtime.list_slots()) == {"alice--a"}
    assert state("alice--b") == "paged_out"
    assert alice.call("/alice/b").text == "b"  # its next call pages it back in
    assert services.capability_reconcile() == {
        "orphans_removed": 0,
        "repaired": 0,
        "pager_corrected": 0,
        "shed": 0,
        **NOTHING_REAPED,
    }


def test_reconcile_repairs_the_pagers_books(capped, alice, celery_worker, settings):
    from datetime import timedelta

    from django.utils import timezone

    for name in ("a", "b", "c"):
        deploy(alice, name, name, type="normal")
    redis = get_redis()
    # What concurrent page-ins used to leave: a live capability counted as evicting...
    redis.zrem(redis_keys.lru("normal"), "alice--a")
    redis.zadd(redis_keys.LRU_EVICTING, {"alice--a": 1})
    # ... a dead placer's claim, and a name the registry does not have.
    redis.zadd(redis_keys.LRU_PLACING, {"alice--gone": 1})
    redis.zadd(redis_keys.lru("persistent"), {"alice--ghost": 1})
    # And a victim whose page-out was never sent (its placement died after placing the newcomer).
    settings.SIGIL_PLACEMENT_LOCK_SECONDS = 1
    Capability.objects.filter(full_name="alice--b").update(
        state="evicting", updated_at=timezone.now() - timedelta(seconds=5)
    )
    redis.zrem(redis_keys.lru("normal"), "alice--b")
    redis.zadd(redis_keys.LRU_EVICTING, {"alice--b": 1})

    result = services.capability_reconcile()
    assert result == {"orphans_removed": 0, "repaired": 0, "pager_corrected": 3, "shed": 0, **NOTHING_REAPED}
    corrected = AuditEvent.objects.filter(action="pager.corrected").values_list("subject", flat=True)
    assert sorted(corrected) == ["alice--a", "alice--ghost", "alice--gone"]
    # The page-out records the row, then drops its evicting mark from the books.
    wait_for(
        lambda: state("alice--b") == "paged_out" and "alice--b" not in pager.pager_locations(),
        message="the lost page-out, sent again",
    )
    assert pager.pager_locations() == {"alice--a": {redis_keys.lru("normal")}, "alice--c": {redis_keys.lru("normal")}}
    assert services.capability_reconcile() == {
        "orphans_removed": 0,
        "repaired": 0,
        "pager_corrected": 0,
        "shed": 0,
        **NOTHING_REAPED,
    }


def test_a_call_that_finds_its_script_gone_pages_in_and_retries(alice, workerd_group):
    deploy(alice, "a", "never-called-before")
    capability = Capability.objects.get(full_name="alice--a")
    (get_runtime().code_dir / f"{capability.placed_sha}.json").unlink()
    (get_runtime().code_dir / "slots" / "alice" / "alice--a").unlink()
    alice_workerd = workerd_group.get("alice")
    pid = alice_workerd.host.process.pid
    alice_workerd.restart()  # and its isolates with it, so that none hides the loss
    wait_for(lambda: alice_workerd.serving() and alice_workerd.snapshot()["pid"] != pid, message="a fresh workerd")
    response = alice.call("/alice/a")
    assert response.status_code == 200 and response.text == "never-called-before", response.text
    assert response.headers["X-Sigil-Cold-Start"] == "1"
    assert AuditEvent.objects.filter(subject="alice--a", action="capability.repaired").exists()
