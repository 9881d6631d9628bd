"""Every accepted piece of work ends, whatever process dies: a Celery worker's main process
killed with -9 mid-deploy or mid-page-in, a host's in-flight counts, transient failures.

Through the real parts: a Celery worker in its own process (solo pool, so the process killed
is the one holding the task), the worker-pool runtime on the Cloudflare emulator with latency
injected so the work is in flight when the kill comes, real Redis and the database. Beat is
stood in for by calling the reaper's service, as beat's task does, every half second.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from agents.models import AuditEvent
from capabilities import services
from capabilities.books import pager
from capabilities.models import Capability, CapabilityVersion
from capabilities.runtimes.worker_pool import pool_script_name
from capabilities.services.deploy_task import DEPLOY_RESENDS
from capabilities.services.placement import placement_lock
from sigil import leases, redis_keys
from sigil.redis_client import get_redis
from testsupport.capability_code import answering as code
from testsupport.cast import deploy_answering as deploy
from testsupport.cast import wait_for
from testsupport.celery_workers import PAGE_IN_A, start_service_process, start_worker_process

LEASE = 2.0
# What docs/architecture.md promises with the defaults (a 15 s lease, reaped every 15 s), scaled to
# this test's lease: a lease, a reap interval, and the placement itself.
BOUND = 4 * LEASE + 10


@pytest.fixture
def short_leases(settings):
    settings.SIGIL_LEASE_SECONDS = LEASE
    return settings


def uploads(emulator, script):
    return [c for c in emulator.api_calls(method="PUT") if c["path"].endswith(f"/workers/scripts/{script}")]


def kill(worker) -> float:
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    return time.monotonic()


def deploy_until_uploaded(worker_pool, agent, name: str, text: str) -> None:
    """Deploy `name`, answering `text`, as `agent`: accepted to be placed in the background
    (202), and in flight until its script's upload reaches the emulator."""
    answer = agent.deploy(name=name, code=code(text))
    assert answer.status_code == 202, answer.text
    wait_for(
        lambda: uploads(worker_pool, pool_script_name(f"{agent.name}--{name}")),
        timeout=30,
        message=f"the upload of {name} to reach Cloudflare",
    )


def kill_mid_deploy(worker_pool, agent, settings, name: str, text: str) -> float:
    """Deploy `name` through a Celery worker of its own (queue "kill-me") while each API call
    takes 1.5 s, and kill the worker's main process once the upload is in flight; returns when
    it was killed, the API back to full speed."""
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 0.5
    settings.SIGIL_DEPLOY_QUEUE = "kill-me"
    worker_pool.configure(latency=1.5)  # each API call takes 1.5 s: the deploy is in flight
    worker = start_worker_process(settings, queue="kill-me")
    try:
        deploy_until_uploaded(worker_pool, agent, name, text)
    finally:
        killed_at = kill(worker)
    worker_pool.configure(latency=0)
    return killed_at


def reap_the_stranded_deploy(full: str, *, killed_at: float) -> None:
    """The first version of `full`, whose placer was killed mid-placement, is placed by the
    reaper within the bound of the kill."""
    version = CapabilityVersion.objects.get(capability__full_name=full, number=1)
    assert version.placement == "placing"  # the kill came mid-placement
    reap_until(
        lambda: CapabilityVersion.objects.get(pk=version.pk).placement != "placing",
        seconds=BOUND,
        message="the stranded deploy to end",
    )
    assert time.monotonic() - killed_at < BOUND
    assert CapabilityVersion.objects.get(pk=version.pk).placement == "placed"


def start_holder(script: str) -> subprocess.Popen:
    """`script` run by another Python process with Django set up and this test's lease, in a
    session of its own (so that `kill` ends it outright)."""
    return subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "sigil_site.settings", "SIGIL_LEASE_SECONDS": str(LEASE)},
        stdout=subprocess.PIPE,
        start_new_session=True,
    )


def reap_until(condition, *, seconds: float, message: str) -> None:
    """Run the reaper as beat would (here every half second) until `condition` holds."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{message}: not within {seconds:g} s"
        services.capability_reap()
        time.sleep(0.5)


@pytest.mark.slow
def test_a_deploy_whose_workers_main_process_is_killed_is_placed_within_the_bound(worker_pool, alice, short_leases):
    settings = short_leases
    killed_at = kill_mid_deploy(worker_pool, alice, settings, "slow", "placed after all")
    settings.SIGIL_DEPLOY_QUEUE = "deploys"  # the surviving workers' queue
    reap_the_stranded_deploy("alice--slow", killed_at=killed_at)
    trail = list(AuditEvent.objects.filter(subject="alice--slow").values_list("action", flat=True))
    assert "capability.deploy_resent" in trail and "capability.created" in trail
    assert alice.call("/alice/slow").text == "placed after all"
    # Its dead placer's claim was given back: the books hold it once, served.
    assert pager.pager_locations()["alice--slow"] == {redis_keys.lru("persistent")}


@pytest.mark.slow
def test_a_deploy_no_worker_takes_after_its_worker_died_is_failed_and_audited(worker_pool, alice, short_leases):
    settings = short_leases
    killed_at = kill_mid_deploy(worker_pool, alice, settings, "lost", "never")
    version = CapabilityVersion.objects.get(capability__full_name="alice--lost", number=1)

    # Nothing consumes "kill-me" any more: every resend is lost too, and then it is ended.
    reap_until(
        lambda: CapabilityVersion.objects.get(pk=version.pk).placement != "placing",
        seconds=BOUND + 4 * 0.5 * DEPLOY_RESENDS,
        message="the deploy nobody places to end",
    )
    assert time.monotonic() - killed_at < 60
    version.refresh_from_db()
    assert version.placement == "failed" and version.failure["code"] == "upstream_error"
    assert "worker placing it was lost" in version.failure["message"]
    assert AuditEvent.objects.filter(subject="alice--lost", action="capability.deploy_resent").count() == 3
    failed = AuditEvent.objects.get(subject="alice--lost", action="capability.deploy_failed")
    assert failed.detail["code"] == "upstream_error"
    assert Capability.objects.get(full_name="alice--lost").state == "failed"
    get_redis().delete("kill-me")


@pytest.mark.slow
def test_a_page_in_whose_worker_died_is_taken_over_by_the_next_call_within_a_lease(worker_pool, alice, short_leases):
    settings = short_leases
    for name in ("a", "b"):
        deploy(alice, name, name, type="normal")
    services.capability_evict(full="alice--a", actor="owner:test")

    worker_pool.configure(latency=4.0)
    worker = start_service_process(settings, PAGE_IN_A)
    try:
        wait_for(
            lambda: get_redis().exists(redis_keys.place_lock("alice--a")),
            timeout=30,
            message="the page-in to take its lock",
        )
        held_since = time.monotonic()
        # Renewed while its holder works: still held well past one lease.
        wait_for(lambda: time.monotonic() - held_since > 2 * LEASE, timeout=10, message="two leases")
        assert get_redis().exists(redis_keys.place_lock("alice--a"))
        assert "alice--a" in pager.pager_placing()
    finally:
        killed_at = kill(worker)
    worker_pool.configure(latency=0)

    response = alice.call("/alice/a")  # the survivor pages it in as soon as the lease is over
    assert response.status_code == 200 and response.text == "a"
    assert time.monotonic() - killed_at < LEASE + 10
    assert pager.pager_locations()["alice--a"] == {redis_keys.lru("normal")}


def test_a_placement_lock_is_renewed_while_held_and_freed_a_lease_after_its_holders_death(short_leases):
    holder = start_holder(HOLD_THE_LOCK)
    try:
        assert holder.stdout.readline().strip() == b"held"
        lock = placement_lock("alice--x", blocking=True, wait_seconds=2 * LEASE)
        started = time.monotonic()
        assert not lock.acquire()  # held past a lease by a live holder
        assert time.monotonic() - started >= 2 * LEASE - 0.2
    finally:
        killed_at = kill(holder)
    lock = placement_lock("alice--x", blocking=True, wait_seconds=3 * LEASE)
    assert lock.acquire()
    taken_after = time.monotonic() - killed_at
    assert taken_after <= LEASE + 0.5
    lock.release()


HOLD_THE_LOCK = """
import django, time
django.setup()
from capabilities.services.placement import placement_lock
lock = placement_lock("alice--x", blocking=True)
assert lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_in_flight_counts_of_a_dead_process_stop_counting_a_lease_after_its_death(short_leases):
    counter = start_holder(COUNT_A_CALL)
    try:
        assert counter.stdout.readline().strip() == b"counted"
        process = pager.pager_inflight_enter("alice--a")  # one call in flight here too
        time.sleep(LEASE * 1.5)
        assert pager.pager_inflight("alice--a") == 2  # both processes live, both calls counted
    finally:
        killed_at = kill(counter)
    wait_for(lambda: pager.pager_inflight("alice--a") == 1, timeout=LEASE + 2, message="the dead count to go")
    assert time.monotonic() - killed_at <= LEASE + 1
    pager.pager_inflight_leave("alice--a", process=process)
    assert pager.pager_inflight("alice--a") == 0
    assert leases.this_process() == process


COUNT_A_CALL = """
import django, time
django.setup()
from capabilities.books import pager
pager.pager_inflight_enter("alice--a")
print("counted", flush=True)
time.sleep(600)
"""


def test_a_deploy_that_fails_transiently_is_retried_before_its_outcome_is_kept(worker_pool, alice, settings):
    from capabilities.runtimes import runtimes_forget

    settings.SIGIL_CF_MAX_RETRIES = 0  # the client gives up at once: the task's retry is what is tested
    runtimes_forget()
    worker_pool.configure(fail_next=2)
    answer = alice.deploy(name="flaky", code=code("there"))
    assert answer.status_code == 201, answer.text
    assert CapabilityVersion.objects.get(capability__full_name="alice--flaky", number=1).placement == "placed"
    assert not AuditEvent.objects.filter(subject="alice--flaky", action="capability.deploy_failed").exists()
    assert alice.call("/alice/flaky").text == "there"


def test_the_stats_script_gives_back_a_count_kept_per_process():
    """The gateway's record of a call takes back the in-flight count its process held, and
    only that one."""
    from capabilities.books import stats

    redis = get_redis()
    record_call = redis.register_script(stats.RECORD_CALLS)

    def record(inflight_key: str, held: str) -> None:
        keys = ["stats", "failures", "open", "trial", "dirty", "used", redis_keys.lru("normal"), inflight_key]
        args = ["alice--a", "token", f"{time.time():.6f}", "1.0", 1, 0, 5, 30, held, "b:1", "", "s:2xx", "", ""]
        record_call(keys=[*keys, "failure-records", "access-log"], args=[*args, 10, "normal", 0])

    process = pager.pager_inflight_enter("alice--a")
    pager.pager_inflight_enter("alice--a")
    assert pager.pager_inflight("alice--a") == 2
    record(redis_keys.inflight_by_process("alice--a"), process)
    assert pager.pager_inflight("alice--a") == 1
    record(redis_keys.inflight_by_process("alice--a"), "0")  # a call that held no count
    assert pager.pager_inflight("alice--a") == 1
    record(redis_keys.inflight_by_process("alice--a"), process)
    assert pager.pager_inflight("alice--a") == 0
