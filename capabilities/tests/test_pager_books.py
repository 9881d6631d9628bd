"""The pager's books on the worker-pool runtime: Sigil over HTTP, the Cloudflare emulator (with
its injected latency and failures), a real Celery worker. Every placed capability is in
exactly one place of the pager's state and the database agrees, the account never holds
more scripts than slots + margin, and a victim is deleted only after its replacement is
placed, once its calls in flight have ended. On an account whose owner's own Workers take
more of the script limit than Sigil reserves for them, Cloudflare's refusals (10037) are a
full pool: Sigil pages out and retries, or sheds, and tells the owner."""

import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import requests
from django.utils import timezone

from agents.models import AuditEvent
from capabilities import services
from capabilities.books import pager
from capabilities.models import Capability
from capabilities.runtimes import get_runtime, runtimes_forget
from capabilities.runtimes.cloudflare import CloudflareNotFound, CloudflareSlotsExhausted, CloudflareUnavailable
from capabilities.runtimes.worker_pool import pool_script_name
from capabilities.tasks import PAGE_OUT_RECHECK_SECONDS, RuntimeTask
from sigil import redis_keys
from sigil.errors import Conflict, Unavailable, UpstreamError
from sigil.redis_client import get_redis
from testsupport.capability_code import answering as code
from testsupport.cast import deploy_answering as deploy
from testsupport.cast import wait_for
from testsupport.emulator import cloudflare_client

# What reconcile's reaper reports when no process died.
NOTHING_REAPED = {"deploys_resent": 0, "deploys_failed": 0, "placing_freed": 0, "page_outs_resent": 0}

SCRIPT_PATH = re.compile(r".*/workers/scripts/(s-[a-z0-9]+)$")
# Code that does not start: the emulator refuses it at upload, as Cloudflare does.
CODE_THAT_DOES_NOT_START = "throw new Error('broken at start'); export default {}"


def state(full):
    return Capability.objects.get(full_name=full).state


def script(full):
    return pool_script_name(full)


def book_problems(scripts_on_cloudflare) -> list[str]:
    """Every way the books disagree, as sentences; none once all work has settled."""
    runtime = get_runtime()
    problems = []
    rows = {
        full: (kind, row_state, slot)
        for full, kind, row_state, slot in Capability.objects.filter(state__in=("live", "evicting")).values_list(
            "full_name", "type", "state", "slot"
        )
    }
    found = pager.pager_locations()
    for full in sorted(set(rows) | set(found)):
        kind, row_state, _ = rows.get(full, (None, None, None))
        want = {"live": {redis_keys.lru(kind or "")}, "evicting": {redis_keys.LRU_EVICTING}}.get(row_state, set())
        if found.get(full, set()) != want:
            problems.append(
                f"{full} is {row_state or 'not placed'} but the pager has it in {sorted(found.get(full, []))}"
            )
    held = {s for s in scripts_on_cloudflare() if s.startswith("s-")}
    if held != {slot for _, _, slot in rows.values()}:
        problems.append(f"Cloudflare holds {sorted(held)}, the registry {sorted(s for *_, s in rows.values())}")
    if len(held) > runtime.total_slots + runtime.safety_margin:
        problems.append(f"{len(held)} scripts, over {runtime.total_slots} slots + {runtime.safety_margin} margin")
    if pager.pager_usage().used > runtime.total_slots:
        problems.append(f"{pager.pager_usage()} uses more than {runtime.total_slots} slots")
    return problems


def most_scripts_at_once(emulator) -> int:
    """The most pool scripts the account held at any time, replayed from the emulator's log."""
    held, most = set(), 0
    for call in emulator.api_calls():
        match = SCRIPT_PATH.fullmatch(call["path"])
        if match and call["status"] == 200:
            if call["method"] == "PUT":
                held.add(match[1])
            elif call["method"] == "DELETE":
                held.discard(match[1])
            most = max(most, len(held))
    return most


def settled():
    """No placement, page-out or slot release left to do."""
    usage = pager.pager_usage()
    return usage.placing == 0 and usage.evicting == 0 and not Capability.objects.filter(state="evicting").exists()


def wait_settled(*, timeout, message):
    """Wait until `settled`; if it never is, say what is still under way."""
    try:
        wait_for(settled, timeout=timeout, message=message)
    except AssertionError as exc:
        evicting = list(Capability.objects.filter(state="evicting").values_list("full_name", flat=True))
        due = get_redis().zrange(redis_keys.PAGE_OUTS_DUE, 0, -1, withscores=True)
        raise AssertionError(
            f"{exc}: {pager.pager_usage()}, evicting in the database {evicting}, "
            f"the pager's {pager.pager_locations()}, page-outs due {due}"
        ) from None


@pytest.fixture
def cf_client(cf_emulator_fresh, redis_client):
    """conftest's client, with a rate budget as wide as the one the stress gives Sigil
    (`six_slots`; they share it in Redis): the owner's uploads and the books' reads go
    through whatever a run spent."""
    client = cloudflare_client(
        cf_emulator_fresh,
        redis_client,
        rate_limit=STRESS_RATE_LIMIT,
        max_retries=4,
        max_rate_wait_seconds=10.0,
        backoff_base_seconds=0.01,
        backoff_max_seconds=0.1,
    )
    yield client
    client.close()


@pytest.fixture
def scripts_on_cloudflare(cf_client):
    return lambda: sorted(s.id for s in cf_client.script_list())


def index_of(calls, method, path_end):
    return next(i for i, c in enumerate(calls) if c["method"] == method and c["path"].endswith(path_end))


def test_concurrent_page_ins_on_a_full_pool_keep_the_books(worker_pool, alice, celery_worker, scripts_on_cloudflare):
    # Two ephemerals paged out by three normals: paging both back in at once, the second
    # would take the first (an ephemeral, still being placed) as its victim if it could.
    first, second = (deploy(alice, None, text, ttl=3600)["capability"] for text in ("first", "second"))
    for name in ("n1", "n2", "n3"):
        deploy(alice, name, name, type="normal")
    wait_for(lambda: state(first) == state(second) == "paged_out", message="the ephemerals paged out")
    worker_pool.configure(latency=0.3, fail_next=2)

    paths = ["/" + first.replace("--", "/")] * 8 + ["/" + second.replace("--", "/")] * 4
    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(lambda path: (r := alice.call(path)) and (r.status_code, r.text), paths))
    assert results == [(200, "first")] * 8 + [(200, "second")] * 4

    worker_pool.configure(latency=0)
    wait_for(settled, timeout=30, message="page-outs to finish")
    assert book_problems(scripts_on_cloudflare) == []
    assert {state(first), state(second)} == {"live"}
    assert most_scripts_at_once(worker_pool) <= 3 + 2
    assert services.capability_reconcile() == {
        "orphans_removed": 0,
        "repaired": 0,
        "pager_corrected": 0,
        "shed": 0,
        **NOTHING_REAPED,
    }


def test_the_victim_is_deleted_only_after_its_replacement_is_placed(worker_pool, alice, celery_worker):
    for name in ("a", "b", "c"):
        deploy(alice, name, name, type="normal")
    worker_pool.configure(latency=0.2)  # a delete sent early would overtake the upload
    assert deploy(alice, "d", "d", type="normal")["evicted"] == "alice--a"
    wait_for(lambda: state("alice--a") == "paged_out", message="a paged out")

    calls = worker_pool.api_calls()
    deleted = index_of(calls, "DELETE", script("alice--a"))
    assert index_of(calls, "PUT", script("alice--d")) < deleted
    assert index_of(calls, "POST", f"{script('alice--d')}/subdomain") < deleted


def test_a_failed_placement_restores_its_victim(worker_pool, alice, celery_worker, settings, scripts_on_cloudflare):
    for name in ("a", "b", "c"):
        deploy(alice, name, name, type="normal")
    last_access = get_redis_score("alice--a")

    refused = alice.deploy(name="d", code=CODE_THAT_DOES_NOT_START, type="normal")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_request"
    settings.SIGIL_CF_MAX_RETRIES = 0
    settings.SIGIL_DEPLOY_RETRIES = 0  # the failure is kept, not tried again
    runtimes_forget()  # a client built with it
    worker_pool.configure(fail_next=1)
    failed = alice.deploy(name="e", code=code("e"), type="normal")
    assert failed.status_code == 502 and failed.json()["error"]["code"] == "upstream_error"

    assert state("alice--a") == "live" and get_redis_score("alice--a") == last_access
    assert book_problems(scripts_on_cloudflare) == []
    assert not worker_pool.api_calls(method="DELETE", path_suffix=script("alice--a"))
    assert not AuditEvent.objects.filter(action="capability.evicted").exists()
    response = alice.call("/alice/a")
    assert response.status_code == 200 and "X-Sigil-Cold-Start" not in response.headers
    # With the failure gone, the same deploy evicts as usual.
    assert deploy(alice, "e", "e", type="normal")["evicted"] == "alice--b"


def test_what_a_failed_placement_left_is_deleted_later_if_cloudflare_fails_again(
    worker_pool, alice, celery_worker, settings, scripts_on_cloudflare
):
    settings.SIGIL_CF_MAX_RETRIES = 0
    settings.SIGIL_DEPLOY_RETRIES = 0  # the failure is kept, not tried again
    # The upload fails, then the delete of what it may have left. Every API call takes half a
    # second, so the background delete, queued before the deploy answers, is still under way
    # when the books are read below.
    worker_pool.configure(fail_next=2, latency=0.5)
    failed = alice.deploy(name="a", code=code("a"), type="normal")
    assert failed.status_code == 502
    # Until its delete is done, the failed placement holds margin rather than a slot.
    assert pager.pager_locations().get("alice--a") == {redis_keys.LRU_EVICTING}
    wait_for(lambda: "alice--a" not in pager.pager_locations(), message="the background delete")
    deletes = worker_pool.api_calls(method="DELETE", path_suffix=script("alice--a"))
    assert [c["status"] >= 500 for c in deletes] == [True, False]
    assert book_problems(scripts_on_cloudflare) == []


def get_redis_score(full):
    return get_redis().zscore(redis_keys.lru("normal"), full)


def test_lowered_slots_are_shed_in_eviction_order(worker_pool, alice, celery_worker, sigil, scripts_on_cloudflare):
    deploy(alice, "keep", "p", type="persistent")
    deploy(alice, "n1", "n1", type="normal")
    deploy(alice, "n2", "n2", type="normal")
    assert alice.call("/alice/n1").text == "n1"  # n2 is now the least recently used normal

    lower_slots(sigil, to=2)
    result = services.capability_reconcile()
    assert result == {"orphans_removed": 0, "repaired": 0, "pager_corrected": 0, "shed": 1, **NOTHING_REAPED}
    wait_for(settled, timeout=30, message="the excess to be paged out")
    assert [state(f) for f in ("alice--n2", "alice--n1", "alice--keep")] == ["paged_out", "live", "live"]
    assert list(AuditEvent.objects.filter(action="capability.evicted").values_list("subject", flat=True)) == [
        "alice--n2"
    ]
    assert book_problems(scripts_on_cloudflare) == []
    assert services.capability_reconcile()["shed"] == 0


def test_a_page_in_after_the_slots_were_lowered_sheds_the_excess_itself(
    worker_pool, alice, celery_worker, sigil, scripts_on_cloudflare
):
    for name in ("a", "b", "c"):
        deploy(alice, name, name, type="normal")
    lower_slots(sigil, to=1)

    assert deploy(alice, "d", "d", type="normal")["cold_start"] is True
    wait_for(settled, timeout=30, message="page-outs to finish")
    assert book_problems(scripts_on_cloudflare) == []
    assert [s for s in scripts_on_cloudflare() if s.startswith("s-")] == [script("alice--d")]


def lower_slots(sigil, *, to):
    """The owner lowers SIGIL_POOL_TOTAL_QUOTA (and restarts Sigil)."""
    from django.conf import settings

    settings.SIGIL_POOL_TOTAL_QUOTA = to + 1 + 2 + 2  # less the reserved scripts and the margin
    runtimes_forget()
    sigil.app.gateway = None  # rebuilt with the new runtime on the next call
    assert get_runtime().total_slots == to


def test_a_call_in_flight_to_a_victim_is_answered_whole(worker_pool, alice, celery_worker):
    slow = """export default { async fetch() {
      await new Promise((resolve) => setTimeout(resolve, 1500));
      return new Response('slow and whole');
    } }"""
    assert alice.deploy(name="a", code=slow, type="normal").status_code == 201
    for name in ("b", "c"):
        deploy(alice, name, name, type="normal")

    with ThreadPoolExecutor(max_workers=1) as pool:
        in_flight = pool.submit(alice.call, "/alice/a")
        wait_for(lambda: pager.pager_inflight("alice--a") == 1, message="the call to be in flight")
        assert deploy(alice, "d", "d", type="normal")["evicted"] == "alice--a"
        response = in_flight.result()
    assert response.status_code == 200 and response.text == "slow and whole"
    wait_for(lambda: state("alice--a") == "paged_out", message="a paged out after its call")
    deleted = worker_pool.api_calls(method="DELETE", path_suffix=script("alice--a"))[0]["time"]
    assert deleted >= time_of_last_access("alice--a")


def time_of_last_access(full):
    # The call's end, as the gateway stamped it for the stats flush.
    return float(get_redis().hget(redis_keys.stats(full), "last_access"))


def test_the_page_out_waits_the_invoke_timeout_and_still_has_its_failure_retries(
    worker_pool, alice, celery_worker, settings
):
    settings.SIGIL_INVOKE_TIMEOUT_SECONDS = 3
    # The wait takes more checks than the task may retry failures: a failure after it is
    # still retried only if the waiting did not use up that budget.
    assert RuntimeTask.max_retries < settings.SIGIL_INVOKE_TIMEOUT_SECONDS / PAGE_OUT_RECHECK_SECONDS
    settings.SIGIL_CF_MAX_RETRIES = 0  # one 5xx is a failed delete
    runtimes_forget()
    for name in ("a", "b", "c"):
        deploy(alice, name, name, type="normal")
    # A call that never ends: its in-flight count (this live process's) is never given back.
    pager.pager_inflight_enter("alice--a")

    assert deploy(alice, "d", "d", type="normal")["evicted"] == "alice--a"
    placed = time.time()
    worker_pool.configure(fail_next=1)  # the next API call, the victim's delete, fails once
    wait_for(lambda: state("alice--a") == "paged_out", timeout=30, message="a paged out after the timeout")

    deletes = worker_pool.api_calls(method="DELETE")
    assert [c["status"] >= 500 for c in deletes] == [True, False]
    assert deletes[0]["time"] >= placed + settings.SIGIL_INVOKE_TIMEOUT_SECONDS


# Sigil's rate budget in the stress runs, and the books' reader's.
STRESS_RATE_LIMIT = 100_000


def stress_plan(rng: random.Random, operations: int, *, owner: bool = False) -> list[tuple[str, str]]:
    """The operations of a stress run, drawn in advance so that a seed gives the same plan:
    (call | deploy | remove | split, a capability name) or (expire | prewarm | owner, ""),
    the owner's steps (adding or deleting a Worker of its own) only when `owner`."""
    plan = []
    for _ in range(operations):
        roll, name = rng.random(), f"c{rng.randrange(20)}"
        if roll < 0.64:
            plan.append(("call", name))
        elif roll < 0.77:
            plan.append(("deploy", name))
        elif roll < 0.85:
            plan.append(("remove", name))
        elif roll < 0.91:
            plan.append(("split", name))
        elif roll < 0.95:
            plan.append(("prewarm", ""))
        elif owner and roll >= 0.97:
            plan.append(("owner", ""))
        else:
            plan.append(("expire", ""))
    return plan


class OwnersWorkers:
    """The owner's own Workers on the account, uploaded through Cloudflare's API without
    Sigil: they share the account's script limit with Sigil's. `base` of them stay for the
    whole run; one more comes and goes (`toggle`), so that the room left to Sigil changes
    mid-run."""

    EXTRA = "owners-extra"

    def __init__(self, cf_client, *, base: int) -> None:
        self.cf_client, self.base = cf_client, base
        self.lock = threading.Lock()
        self.changes = 0

    def _upload(self, name: str) -> None:
        site = {"main.js": code(f"the owner site {name}")}
        self.cf_client.script_upload(name, modules=site, main_module="main.js", compatibility_date="2025-01-01")

    def start(self) -> None:
        for i in range(self.base):
            self._upload(f"owners-{i}")

    def toggle(self) -> None:
        """Add the extra Worker, or delete it. The account may refuse the owner's upload as
        it refuses Sigil's (10037), and Cloudflare's injected failures reach the owner too."""
        with self.lock:
            try:
                if self.EXTRA in {s.id for s in self.cf_client.script_list()}:
                    self.cf_client.script_delete(self.EXTRA)
                else:
                    self._upload(self.EXTRA)
                self.changes += 1
            except (CloudflareSlotsExhausted, CloudflareUnavailable, CloudflareNotFound):
                pass


def refusals_for_want_of_room(calls) -> int:
    """Uploads of Sigil's pool scripts the account refused with 10037."""
    return sum(1 for c in calls if c["method"] == "PUT" and SCRIPT_PATH.fullmatch(c["path"]) and c.get("code") == 10037)


def run_stress(*, seed, alice, emulator, scripts_on_cloudflare, operations, owner: OwnersWorkers | None = None):
    """Randomized concurrent calls, deploys, removes, expiries, traffic splits (staged
    versions placed beside their capability, then promoted or aborted) and prewarm runs of
    20 capabilities on six slots, with Cloudflare's latency and failures injected; then the
    books, and every capability answering with its current code.

    With `owner`, the owner's own Workers take more of the account's script limit than
    Sigil reserves for them, and come and go mid-run: the account refuses Sigil's uploads
    with 10037 though the pager has a slot, and Sigil pages out for it or sheds (503)."""
    from capabilities.services import capability_expire_ephemerals

    print(f"pager stress seed: {seed}" + (f", the owner's Workers taking {owner.base}+ scripts" if owner else ""))
    plan = stress_plan(random.Random(seed), operations, owner=owner is not None)
    # Only a full account sheds a placement: without the owner's Workers, a 503 is a bug.
    shed = {503} if owner else set()

    def answered(response, statuses):
        assert response.status_code in statuses | shed, (response.status_code, response.text)
        if response.status_code == 503:
            error = response.json()["error"]
            assert error["code"] == "unavailable" and "no room" in error["message"], error
            assert int(response.headers["Retry-After"]) > 0

    # c0, c4, ... are ephemeral: Sigil names them (t-...), so the plan's name maps to the
    # latest one deployed for it; their TTLs are short enough that some expire mid-run.
    kinds = {f"c{i}": ("persistent", "normal", "normal", "ephemeral")[i % 4] for i in range(20)}
    ephemeral_names: dict[str, str] = {}
    # A new version whose upload succeeded but whose workers.dev toggle failed is served
    # although the deploy failed (the registry keeps the previous version): a runtime matter,
    # not the pager's books.
    failed_deploys: dict[str, set[str]] = {}

    def full_of(name):
        return ephemeral_names.get(name) if kinds[name] == "ephemeral" else f"alice--{name}"

    def deploy_one(step, name):
        text = f"{name} at step {step}"
        if kinds[name] == "ephemeral":
            # The first deploys live long; later ones expire within seconds, some mid-run.
            ttl = 3600 if step < 0 else 2 + step % 5
            response = alice.deploy(name=None, code=code(text), type="ephemeral", ttl=ttl)
            if response.status_code == 201:
                ephemeral_names[name] = response.json()["capability"]
        else:
            response = alice.deploy(name=name, code=code(text), type=kinds[name])
            if response.status_code == 502:
                failed_deploys.setdefault(f"alice--{name}", set()).add(text)
        # 409: a deploy of the same capability is under way; 502: Cloudflare failed past
        # the client's retries; 429: the agent's live ephemerals are at their limit.
        answered(response, {200, 201, 409, 429, 502})

    def split_one(step, name):
        """Stage a version and send half the callers to it; or end the split running."""
        if kinds[name] == "ephemeral":
            return  # ephemerals have no staged versions
        full = f"alice--{name}"
        capability = Capability.objects.exclude(state="removed").filter(full_name=full).first()
        if capability is None:
            return
        base, headers = f"{alice.base_url}/_api/capabilities/{full}/split", alice.headers(alice.deploy_token)
        if capability.split_weight is None:
            staged = alice.deploy(name=name, code=code(f"{name} staged at step {step}"), stage=True)
            # 404: removed meanwhile; 409: a split started meanwhile.
            answered(staged, {200, 404, 409})
            response = alice.session.put(base, json={"weight": 50}, headers=headers, timeout=60)
        else:
            how = ("promote", "abort")[step % 2]
            response = alice.session.post(f"{base}/{how}", headers=headers, timeout=60)
        # 404: removed; 409: nothing staged, or a placement of it under way; 502: Cloudflare failed.
        answered(response, {200, 404, 409, 502})

    # One prewarm step at a time, so that the audit trail after `before` is this run's alone
    # (Sigil itself runs one at a time: a second finds the first's lease and places nothing).
    prewarm_turn = threading.Lock()

    def prewarm_once():
        with prewarm_turn:
            prewarm_judged()

    def prewarm_judged():
        before = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
        services.capability_flush_stats()
        try:
            warmed = services.capability_prewarm()
        except UpstreamError:
            return  # a page-in met Cloudflare's failures: the task runs it again
        except Unavailable:
            if owner is None:
                raise
            return  # a page-in was shed on the full account: the task runs it again
        # Its page-ins page nothing out themselves (neither the pager's victim nor one for
        # the account); what it paged out to make room is outside the top-N, so never one
        # of those it placed.
        paged_in = AuditEvent.objects.filter(
            id__gt=before, action="capability.paged_in", subject__in=warmed, detail__reason="prewarm"
        )
        assert [e.detail["evicted"] for e in paged_in] == [None] * len(warmed), warmed
        paged_out = AuditEvent.objects.filter(id__gt=before, action="capability.evicted", detail__reason="prewarm")
        assert not set(paged_out.values_list("subject", flat=True)) & set(warmed), warmed

    def run(step, action, name):
        full = full_of(name) if name else None
        if action == "call" and full:
            response = alice.call("/" + full.replace("--", "/", 1))
            # 404: removed or expired by another step; 502: its page-in met Cloudflare's failures.
            answered(response, {200, 404, 502})
        elif action == "deploy":
            deploy_one(step, name)
        elif action == "remove" and full:
            response = alice.session.delete(
                f"{alice.base_url}/_api/capabilities/{full}", headers=alice.headers(alice.deploy_token), timeout=60
            )
            assert response.status_code in (204, 404), response.text
        elif action == "expire":
            capability_expire_ephemerals()
        elif action == "split":
            split_one(step, name)
        elif action == "prewarm":
            prewarm_once()
        elif action == "owner":
            owner.toggle()

    if owner:
        owner.start()
    for name in sorted(kinds):  # all twenty first: most calls then page in
        deploy_one(-1, name)
    # The gateway asks Cloudflare for the account's workers.dev subdomain on its first call,
    # and does not answer in the contract if that fails: not this test's subject.
    assert alice.call("/alice/c1").status_code == 200
    if owner:
        # The traffic starts with the owner's extra Worker on the account, uploaded once
        # Sigil's page-outs leave it room.
        wait_settled(timeout=60, message="the first page-outs")
        owner.toggle()
        assert owner.changes == 1
    traffic_starts = len(emulator.api_calls())
    emulator.configure(latency=0.02, fault_rate=0.05, fault_seed=seed)
    with ThreadPoolExecutor(max_workers=6) as pool:
        for future in [pool.submit(run, step, *item) for step, item in enumerate(plan)]:
            future.result()

    emulator.configure(latency=0, fault_rate=0)

    # The splits still running end, so that every caller gets the current version.
    def split_aborted(pk):
        capability = Capability.objects.exclude(state="removed").filter(pk=pk, split_weight__isnull=False).first()
        if capability is None:
            return True
        try:
            services.capability_split_abort(capability=capability, actor="owner:test")
        except Conflict:
            return False  # a placement of it is still under way (a deploy's retries, a page-out)
        return True

    splitting = Capability.objects.exclude(state="removed").filter(split_weight__isnull=False)
    for pk in splitting.values_list("pk", flat=True):
        wait_for(lambda pk=pk: split_aborted(pk), timeout=60, message="the split's placement lock")
    wait_settled(timeout=60, message="all page-outs and releases to finish")
    evictions = AuditEvent.objects.filter(action="capability.evicted").count()
    faults = len([c for c in emulator.api_calls() if c["status"] >= 500])
    print(f"{evictions} evictions, {faults} injected Cloudflare failures")
    assert evictions >= 20 and faults >= 10  # the run did page, and failed to
    splits = AuditEvent.objects.filter(action="capability.split_started").count()
    prewarmed = AuditEvent.objects.filter(action="capability.paged_in", detail__reason="prewarm").count()
    print(f"{splits} splits started, {prewarmed} prewarmed")
    assert splits >= 3  # staged versions took slots of their own
    calls = emulator.api_calls()
    refusals, during_traffic = refusals_for_want_of_room(calls), refusals_for_want_of_room(calls[traffic_starts:])
    told = AuditEvent.objects.filter(action="runtime.account_full")
    print(f"{refusals} uploads refused for want of room ({during_traffic} mid-run), {told.count()} told")
    if owner:
        assert during_traffic >= 1  # the account really was full mid-run
        warning = requests.get(f"{alice.base_url}/_health", timeout=10).json()["warnings"]
        assert any("refused a script for want of room" in w for w in warning), warning
    assert told.count() == refusals  # every refusal was told to the owner
    assert book_problems(scripts_on_cloudflare) == []
    runtime = get_runtime()
    assert most_scripts_at_once(emulator) <= runtime.total_slots + runtime.safety_margin

    # Every capability still answers, with its current code (ephemerals about to expire aside).
    soon = timezone.now() + timedelta(seconds=30)
    alive = (
        Capability.objects.exclude(state="removed")
        .exclude(expires_at__lt=soon)
        .filter(variant_of__isnull=True)
        .select_related("current_version")
    )
    for capability in alive:
        # The owner's Workers still take their share: a page-in now meets its refusals alone.
        response = alice.call("/" + capability.full_name.replace("--", "/", 1))
        text = re.search(r"new Response\('(.*)'\)", capability.current_version.code)[1]
        assert response.status_code == 200, (capability.full_name, response.text)
        assert response.text in {text} | failed_deploys.get(capability.full_name, set()), capability.full_name
    wait_settled(timeout=60, message="the last page-outs")
    assert book_problems(scripts_on_cloudflare) == []
    assert services.capability_reconcile() == {
        "orphans_removed": 0,
        "repaired": 0,
        "pager_corrected": 0,
        "shed": 0,
        **NOTHING_REAPED,
    }
    assert told.count() == refusals_for_want_of_room(emulator.api_calls())
    if owner:
        owners = [s for s in scripts_on_cloudflare() if s.startswith("owners-")]
        assert len(owners) >= owner.base  # Sigil never touched the owner's Workers


@pytest.fixture
def six_slots(worker_pool, settings):
    settings.SIGIL_POOL_TOTAL_QUOTA = 11  # 11 - 1 - 2 reserved - 2 margin: six slots
    settings.SIGIL_CF_RATE_LIMIT = STRESS_RATE_LIMIT  # the stress is about interleavings, not the rate budget
    settings.SIGIL_CF_MAX_RETRIES = 0  # every injected failure reaches the pager
    # Above what Sigil may hold, so that going over shows in the books instead of as a refusal.
    worker_pool.configure(script_limit=50, rate_limit="100000/1")
    return worker_pool


def owners_share(emulator, cf_client) -> OwnersWorkers:
    """The account's real limit is the quota Sigil was told (11 scripts, the system script
    elsewhere), but the owner runs 3 Workers of its own where 2 were reserved, and a fourth
    comes and goes: Sigil's six slots and margin of two (8 scripts) meet 10037 at 7, or 6."""
    emulator.configure(script_limit=11 - 1)
    return OwnersWorkers(cf_client, base=3)


# 2503362766 once left a deploy unanswered for 30 s at step 561 of 600: kept as a case.
@pytest.mark.parametrize(("seed", "operations"), [(20261201, 300), (2503362766, 600)])
def test_randomized_concurrent_traffic_keeps_the_books(
    seed, operations, six_slots, alice, celery_worker, scripts_on_cloudflare
):
    run_stress(
        seed=seed, alice=alice, emulator=six_slots, scripts_on_cloudflare=scripts_on_cloudflare, operations=operations
    )


def test_randomized_traffic_on_an_account_the_owners_workers_share_keeps_the_books(
    six_slots, alice, celery_worker, cf_client, scripts_on_cloudflare
):
    run_stress(
        seed=20261202,
        alice=alice,
        emulator=six_slots,
        scripts_on_cloudflare=scripts_on_cloudflare,
        operations=300,
        owner=owners_share(six_slots, cf_client),
    )


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["sigil-alone", "owners-workers-share"])
def test_randomized_concurrent_traffic_keeps_the_books_on_a_random_seed(
    shared, six_slots, alice, celery_worker, cf_client, scripts_on_cloudflare
):
    seed = int(os.environ.get("SIGIL_STRESS_SEED") or random.SystemRandom().randrange(2**32))
    run_stress(
        seed=seed,
        alice=alice,
        emulator=six_slots,
        scripts_on_cloudflare=scripts_on_cloudflare,
        operations=600,
        owner=owners_share(six_slots, cf_client) if shared else None,
    )
