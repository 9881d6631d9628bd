"""The worker-pool runtime end to end: Sigil's REST API and gateway over HTTP, the Cloudflare
emulator over HTTP (its scripts running on workerd), and a real Celery worker."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from agents.models import AuditEvent
from capabilities import services
from capabilities.models import Capability
from capabilities.runtimes import build_runtime, runtimes_forget
from capabilities.runtimes.cloudflare.account import installation_tag
from capabilities.runtimes.worker_pool import pool_script_name
from testsupport.capability_code import answering as code
from testsupport.cast import deploy_answering as deploy
from testsupport.cast import wait_for
from testsupport.celery_workers import PAGE_IN_A, start_service_process, start_worker_process


@pytest.fixture
def scripts_on_cloudflare(cf_client):
    """Every script name the emulated account holds, asked over its REST API."""
    return lambda: sorted(script.id for script in cf_client.script_list())


def uploads(emulator, script=None):
    calls = emulator.api_calls(method="PUT")
    return [c for c in calls if "/workers/scripts/" in c["path"] and (script is None or c["path"].endswith(script))]


@pytest.fixture
def api_headers(worker_pool):
    return {"Authorization": f"Bearer {worker_pool.token}"}


def test_quota_fill_evicts_in_the_seed_order_and_never_exceeds_the_quota(
    worker_pool, alice, celery_worker, scripts_on_cloudflare
):
    deploy(alice, "keep", "p", type="persistent")
    deploy(alice, "norm", "n", type="normal")
    ephemeral = deploy(alice, None, "e")["capability"]
    assert alice.call("/alice/norm").text == "n"

    first = deploy(alice, "norm2", "n2", type="normal")
    assert first == {**first, "cold_start": True, "evicted": ephemeral}
    second = deploy(alice, "norm3", "n3", type="normal")
    assert second["evicted"] == "alice--norm"
    wait_for(lambda: Capability.objects.get(full_name="alice--norm").state == "paged_out", message="page-out")

    scripts = [s for s in scripts_on_cloudflare() if s.startswith("s-")]
    assert len(scripts) <= 3 + 2
    assert pool_script_name("alice--keep") in scripts
    status = alice.call("/_api/status").json()
    assert status == {**status, "backend": "worker-pool", "total_slots": 3, "lru_enabled": True, "eviction_count": 2}


def test_a_repaged_capability_keeps_its_script_name_and_url(worker_pool, alice, celery_worker, scripts_on_cloudflare):
    for name in ("a", "b", "c", "d"):
        deploy(alice, name, name, type="normal")
    wait_for(lambda: Capability.objects.get(full_name="alice--a").state == "paged_out", message="a paged out")
    script = pool_script_name("alice--a")
    assert script not in scripts_on_cloudflare()

    response = alice.call("/alice/a")
    assert response.status_code == 200 and response.text == "a"
    assert response.headers["X-Sigil-Cold-Start"] == "1"
    assert Capability.objects.get(full_name="alice--a").slot == script
    assert len(uploads(worker_pool, script)) == 2  # the deploy, and the page-in, both as s-{hash6}


def test_fifty_concurrent_calls_to_one_cold_capability_upload_it_once(worker_pool, alice, celery_worker):
    for name in ("a", "b", "c", "d"):
        deploy(alice, name, name, type="normal")
    wait_for(lambda: Capability.objects.get(full_name="alice--a").state == "paged_out", message="a paged out")
    script = pool_script_name("alice--a")
    before = len(uploads(worker_pool, script))

    with ThreadPoolExecutor(max_workers=25) as pool:
        results = list(
            pool.map(lambda _: (r := alice.call("/alice/a")).status_code and (r.status_code, r.text), range(50))
        )
    assert results == [(200, "a")] * 50
    assert len(uploads(worker_pool, script)) == before + 1


def test_ten_cold_capabilities_at_once_under_a_tight_rate_limit_all_succeed(worker_pool, alice, settings):
    # Cloudflare (the emulator) allows 8 calls a second, and so does Sigil's shared budget;
    # ten page-ins at once are twenty calls: the burst must queue, never meet a 429.
    settings.SIGIL_CF_RATE_LIMIT = 8
    settings.SIGIL_CF_RATE_WINDOW_SECONDS = 1
    worker_pool.configure(rate_limit="8/1")
    settings.SIGIL_POOL_TOTAL_QUOTA = 40  # room for all ten: this test is about the rate limit
    worker_pool.configure(script_limit=39)
    for i in range(10):
        deploy(alice, f"c{i}", f"c{i}", type="normal")
        services.capability_evict(full=f"alice--c{i}", actor="owner:test")
    calls_before = len(worker_pool.api_calls())

    with ThreadPoolExecutor(max_workers=10) as pool:
        results = list(pool.map(lambda i: (r := alice.call(f"/alice/c{i}")) and (r.status_code, r.text), range(10)))
    assert results == [(200, f"c{i}") for i in range(10)]
    burst = worker_pool.api_calls()[calls_before:]
    assert not [c for c in burst if c["status"] == 429]
    # Two calls a page-in (the upload and the workers.dev toggle), none retried.
    assert len([c for c in burst if c["method"] == "PUT"]) == 10
    assert len([c for c in burst if c["method"] == "POST" and c["path"].endswith("/subdomain")]) == 10


@pytest.mark.parametrize("window", [45, 20], ids=["room-past-the-wait", "room-within-the-wait"])
def test_a_cold_call_under_a_spent_budget_answers_within_the_calls_timeout(worker_pool, alice, settings, window):
    # Sigil's own budget is spent, and room comes back within `window` s; a page-in needs two
    # API calls. Past the longest wait the call is refused at once (503, Retry-After); within
    # it, the page-in waits for room, but never makes the caller wait past the call's timeout.
    from capabilities.runtimes.cloudflare.client import CloudflareClient
    from capabilities.runtimes.cloudflare.errors import CloudflareRateLimited

    settings.SIGIL_INVOKE_TIMEOUT_SECONDS = 30
    # What deploying Sigil's own Workers costs (with the edge on, its Worker): at most that again
    # when the set-up's process checks them at its first placement.
    before = len(worker_pool.api_calls())
    build_runtime("worker-pool").provision()
    provisioning = len(worker_pool.api_calls()) - before
    settings.SIGIL_CF_RATE_LIMIT = 12 + 2 * provisioning  # room for the set-up below; the spender eats the rest
    settings.SIGIL_CF_RATE_WINDOW_SECONDS = window
    runtimes_forget()
    for name in ("a", "b", "c", "d"):  # three slots: `a` is paged out
        deploy(alice, name, name, type="normal")
    wait_for(lambda: Capability.objects.get(full_name="alice--a").state == "paged_out", message="a paged out")
    assert alice.call("/alice/b").text == "b"
    waits = settings.SIGIL_CF_MAX_RATE_WAIT_SECONDS
    settings.SIGIL_CF_MAX_RATE_WAIT_SECONDS = 0  # a client of the same budget that never waits
    spender = CloudflareClient.from_settings()
    settings.SIGIL_CF_MAX_RATE_WAIT_SECONDS = waits
    with pytest.raises(CloudflareRateLimited):
        spend(spender, settings.SIGIL_CF_RATE_LIMIT)  # what is left of the window
    started = time.monotonic()
    answer = alice.call("/alice/a")
    took = time.monotonic() - started
    assert took < settings.SIGIL_INVOKE_TIMEOUT_SECONDS + 2, f"the caller waited {took:.1f} s"
    if answer.status_code != 200:
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "unavailable", answer.text
        assert int(answer.headers["Retry-After"]) >= 1
    if window > settings.SIGIL_CF_MAX_RATE_WAIT_SECONDS + 10:
        assert answer.status_code == 503 and took < 5  # refused at once, not after waiting


def spend(client, calls: int) -> None:
    for _ in range(calls):
        client.script_list()


def spend_elsewhere(emulator, calls: int) -> None:
    """API calls on Sigil's token from outside Sigil (the owner's dashboard or scripts)."""
    url = f"{emulator.api_base}/accounts/{emulator.account_id}/workers/scripts"
    for _ in range(calls):
        requests.get(url, headers={"Authorization": f"Bearer {emulator.token}"}, timeout=10)


def test_cloudflares_lockout_is_503_unavailable_with_its_retry_after_in_sigils_words(worker_pool, alice):
    deploy(alice, "cold", "c", type="normal")
    services.capability_evict(full="alice--cold", actor="owner:test")
    worker_pool.configure(rate_limit="3/60")
    spend_elsewhere(worker_pool, 3)  # the window is spent: Sigil's next call locks the token out
    started = time.monotonic()
    response = alice.deploy(name="locked", code=code("x"))
    assert time.monotonic() - started < 10  # refused at once, not after the budget's waits
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "unavailable"
    assert 55 <= int(response.headers["Retry-After"]) <= 60
    # One statement, whose time is the header's.
    seconds = response.headers["Retry-After"]
    assert error["message"] == f"Sigil could not place alice--locked: the runtime's API is rate-limited for {seconds} s"
    # Cloudflare's internals (its code, its limit, its wording) stay in Sigil's log.
    assert not any(word in error["message"] for word in ("971", "requests per", "Cloudflare answered"))
    assert {c["code"] for c in worker_pool.api_calls() if c["status"] == 429} == {971}

    # A call that must page a capability in meets the same lockout the same way.
    called = alice.call("/alice/cold")
    assert called.status_code == 503, called.text
    assert called.json()["error"]["code"] == "unavailable"
    assert 50 <= int(called.headers["Retry-After"]) <= 60
    assert "971" not in called.json()["error"]["message"]


def owners_own_scripts(cf_client, count: int) -> None:
    """Workers of the owner's own on the account, which share its script quota with Sigil's."""
    for i in range(count):
        site = {"main.js": code("site")}
        cf_client.script_upload(f"owners-{i}", modules=site, main_module="main.js", compatibility_date="2025-01-01")


def test_an_account_full_of_the_owners_workers_pages_out_and_retries_and_tells_the_owner(
    worker_pool, alice, cf_client, scripts_on_cloudflare
):
    # 3 slots and 2 scripts reserved for the owner; the owner runs 5: the account (7 scripts, 8
    # with the edge's Worker) refuses Sigil's third with 10037 though the pager has room for it.
    owners_own_scripts(cf_client, 5)
    deploy(alice, "a", "a", type="normal")
    deploy(alice, "b", "b", type="normal")
    assert alice.call("/alice/b").text == "b"  # a is the least recently used
    third = deploy(alice, "c", "c", type="normal")
    assert third["evicted"] == "alice--a"
    assert alice.call("/alice/c").text == "c"
    assert len(scripts_on_cloudflare()) == worker_pool.config()["script_limit"]  # full
    assert [c["code"] for c in worker_pool.api_calls(method="PUT") if c["status"] == 400] == [10037]
    assert Capability.objects.get(full_name="alice--a").state == "paged_out"
    told = AuditEvent.objects.get(action="runtime.account_full")
    assert told.detail["capability"] == "alice--c" and told.detail["paged_out"] == "alice--a"
    health = requests.get(f"{alice.base_url}/_health", timeout=10)
    assert health.status_code == 200  # Sigil still serves
    assert "refused a script for want of room" in health.json()["warnings"][0]
    # a comes back the same way when called, paging out the least recently used again.
    assert alice.call("/alice/a").text == "a"
    assert Capability.objects.get(full_name="alice--b").state == "paged_out"


def test_a_capability_is_shed_when_the_account_is_full_and_nothing_can_be_paged_out(
    worker_pool, alice, cf_client, scripts_on_cloudflare
):
    owners_own_scripts(cf_client, 7)
    started = time.monotonic()
    response = alice.deploy(name="shed", code=code("x"))
    assert time.monotonic() - started < 10
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "unavailable" and "Retry-After" in response.headers
    assert "no room" in response.json()["error"]["message"]
    assert AuditEvent.objects.filter(action="runtime.account_full", detail__paged_out=None).exists()
    assert len(scripts_on_cloudflare()) == worker_pool.config()["script_limit"]  # full


def test_cloudflare_5xx_is_retried_and_the_deploy_served(worker_pool, alice):
    worker_pool.configure(fail_next=2)
    response = alice.deploy(name="resilient", code=code("still here"))
    assert response.status_code == 201, response.text
    statuses = [c["status"] for c in worker_pool.api_calls()]
    assert statuses.count(200) >= 2 and any(s >= 500 for s in statuses)
    assert alice.call("/alice/resilient").text == "still here"


def test_the_owners_own_scripts_are_never_touched(worker_pool, alice, cf_client, scripts_on_cloudflare):
    cf_client.script_upload(
        "owners-site", modules={"main.js": code("mine")}, main_module="main.js", compatibility_date="2025-01-01"
    )
    deploy(alice, "a", "a")
    assert services.capability_reconcile()["orphans_removed"] == 0
    assert "owners-site" in scripts_on_cloudflare()
    assert alice.call("/_api/status").json()["used_slots"] == 1


def test_reconcile_deletes_only_the_orphans_this_installation_created(
    worker_pool, alice, cf_client, scripts_on_cloudflare, settings
):
    upload = {"main_module": "main.js", "compatibility_date": "2025-01-01"}
    # The owner's own Worker, named and tagged as Sigil's are: never Sigil's to delete.
    cf_client.script_upload("s-0ca5e1", modules={"main.js": code("mine")}, tags=["sigil"], **upload)
    # One this installation left behind (a placement whose worker died before recording it).
    mine = installation_tag(settings.SIGIL_INTERNAL_SECRET)
    cf_client.script_upload("s-1eft0f", modules={"main.js": code("left")}, tags=["sigil", mine], **upload)
    deploy(alice, "a", "a")

    assert services.capability_reconcile()["orphans_removed"] == 1
    assert "s-0ca5e1" in scripts_on_cloudflare() and "s-1eft0f" not in scripts_on_cloudflare()
    assert AuditEvent.objects.filter(action="runtime.orphan_removed").values_list("subject", flat=True).get() == (
        "s-1eft0f"
    )
    assert services.capability_reconcile()["orphans_removed"] == 0
    assert alice.call("/alice/a").text == "a"


def test_redirect_mode_answers_302_to_the_workers_dev_url(worker_pool, alice, settings):
    settings.SIGIL_POOL_REDIRECT = True
    deploy(alice, "a", "a")
    response = alice.call("/alice/a/path?q=1", allow_redirects=False)
    script = pool_script_name("alice--a")
    assert response.status_code == 302
    assert response.headers["Location"] == f"https://{script}.{worker_pool.subdomain}.workers.dev/path?q=1"
    direct = worker_pool.worker_request(worker_pool.workers_dev_host(script), "/")
    assert direct.text == "a"  # no guard: the URL itself is the credential


@pytest.mark.slow
def test_a_worker_killed_during_a_page_in_converges_after_reconcile(
    worker_pool, alice, settings, scripts_on_cloudflare
):
    settings.SIGIL_PLACEMENT_LOCK_SECONDS = 3
    for name in ("a", "b", "c", "d"):
        deploy(alice, name, name, type="normal")
    services.capability_evict(full="alice--a", actor="owner:test")
    assert Capability.objects.get(full_name="alice--a").state == "paged_out"

    worker_pool.configure(latency=1.5)  # each API call takes 1.5 s: time to kill mid-page-in
    worker = start_service_process(settings, PAGE_IN_A)
    try:
        # Killed after the upload, while it turns the workers.dev URL on: Cloudflare holds a
        # script that the registry does not know is live.
        wait_for(
            lambda: uploads(worker_pool, pool_script_name("alice--a")),
            timeout=20,
            message="the page-in's upload to reach Cloudflare",
        )
        time.sleep(0.5)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    worker_pool.configure(latency=0)
    time.sleep(2)  # let the emulator finish what it accepted, and the dead worker's lock expire
    time.sleep(settings.SIGIL_PLACEMENT_LOCK_SECONDS)

    services.capability_reconcile()
    live = {c.slot for c in Capability.objects.filter(state__in=("live", "evicting"))}
    assert {s for s in scripts_on_cloudflare() if s.startswith("s-")} == live  # no orphan, nothing lost
    assert alice.call("/alice/a").text == "a"


def test_a_script_cloudflare_lost_is_a_miss_paged_in_on_the_call(worker_pool, alice, cf_client):
    deploy(alice, "a", "a")
    cf_client.script_delete(pool_script_name("alice--a"))  # gone behind Sigil's back
    response = alice.call("/alice/a")
    assert response.status_code == 200 and response.text == "a"
    assert response.headers["X-Sigil-Cold-Start"] == "1"
    assert AuditEvent.objects.filter(subject="alice--a", action="capability.repaired").exists()


def test_a_chunked_call_to_a_lost_script_never_reaches_it_without_its_body(worker_pool, alice, cf_client):
    """Production servers hand the gateway a chunked body with no Content-Length; a lost
    script is paged in again only for bodiless calls, since a body cannot be sent twice."""
    from testsupport.capability_code import ECHO
    from testsupport.engine_calls import answers, call_request

    assert alice.deploy(name="echo", code=ECHO).status_code == 201
    cf_client.script_delete(pool_script_name("alice--echo"))

    async def body():
        yield b"the body"

    request = call_request(alice, "/alice/echo", method="POST", headers={"transfer-encoding": "chunked"})
    request.body, request.chunked = body(), True
    ((status, _, answered),) = answers([request])[0:1][0]
    assert status != 207, answered  # the echo never answered an empty body
    assert alice.call("/alice/echo").status_code == 207  # a bodiless call pages it in again
    assert alice.call("/alice/echo", method="POST", data=b"the body").json()["body"] == "the body"


def test_a_capabilitys_own_404_is_not_taken_for_a_lost_script(worker_pool, alice):
    own_404 = "export default { async fetch() { return new Response('no such page', { status: 404 }) } }"
    alice.deploy(name="nothing", code=own_404)
    response = alice.call("/alice/nothing")
    assert response.status_code == 404 and response.text == "no such page"
    assert "X-Sigil-Cold-Start" not in response.headers
    assert not AuditEvent.objects.filter(subject="alice--nothing", action="capability.repaired").exists()


def test_cloudflare_failing_when_asked_where_scripts_answer_is_a_502_in_the_envelope(
    worker_pool, alice, settings, sigil
):
    deploy(alice, "a", "a")
    # A fresh process: the account's subdomain is asked for on the first call it routes.
    runtimes_forget()
    sigil.app.gateway = None
    settings.SIGIL_CF_MAX_RETRIES = 0
    worker_pool.configure(fail_next=1)
    failed = alice.call("/alice/a")
    assert failed.status_code == 502, failed.text
    assert failed.json()["error"]["code"] == "upstream_error"
    assert alice.call("/alice/a").text == "a"  # asked again on the next call, and answered


@pytest.fixture
def deploys_held(worker_pool, settings):
    """Deploys go to a queue no worker of the session takes, as when every deploy worker is
    down; the session's workers are left as they are."""
    settings.SIGIL_DEPLOY_QUEUE = f"deploys-held-{os.getpid()}"
    return settings.SIGIL_DEPLOY_QUEUE


def versions_shown_to_the_owner(admin_client, full: str) -> str:
    """The versions table of the capability's admin page, as HTML."""
    page = admin_client.get(f"/admin/capabilities/capability/{Capability.objects.get(full_name=full).pk}/change/")
    assert page.status_code == 200
    return page.content.decode().split('<table id="versions">', 1)[1].split("</table>", 1)[0]


@pytest.mark.slow
def test_a_deploy_waits_for_a_celery_worker_and_is_placed_when_one_starts(
    worker_pool, alice, settings, deploys_held, scripts_on_cloudflare, admin_client
):
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 1
    queued = alice.deploy(name="later", code=code("placed later"))
    assert queued.status_code == 202, queued.text
    body = queued.json()
    assert body["status"] == "deploying" and body["version"] == 1
    assert body["callback"] == "/_status/alice--later"
    assert alice.call(body["callback"]).json()["status"] == "deploying"
    assert alice.call("/alice/later").status_code == 404  # recorded, not served yet
    # Refused code, and a capability removed before its placement runs, wait with it.
    assert alice.deploy(name="broken", code="export default {").status_code == 202
    assert alice.deploy(name="gone", code=code("never placed")).status_code == 202
    assert alice.call("/_api/capabilities/alice--gone", method="DELETE", token="deploy").status_code == 204
    assert uploads(worker_pool) == []  # nothing reached Cloudflare from the web request
    assert "being placed…" in versions_shown_to_the_owner(admin_client, "alice--later")

    worker = start_worker_process(settings, queue=deploys_held)
    try:
        wait_for(
            lambda: alice.call("/_status/alice--later").json()["status"] == "ready",
            timeout=60,
            message="the deploy to be placed once a worker started",
        )
        wait_for(
            lambda: alice.call("/_status/alice--broken").json()["status"] == "failed",
            timeout=30,
            message="the broken deploy's failure",
        )
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)

    assert alice.call("/alice/later").text == "placed later"
    later = alice.call("/_api/capabilities/alice--later").json()
    assert later["version"] == 1 and later["state"] == "live" and later["deploy"] is None
    broken = alice.call("/_api/capabilities/alice--broken").json()
    assert broken["state"] == "failed" and broken["version"] is None
    assert broken["deploy"]["status"] == "failed" and broken["deploy"]["version"] == 1
    assert broken["deploy"]["error"]["code"] == "invalid_request"
    assert "refused the script" in broken["deploy"]["error"]["message"]
    assert alice.call("/alice/broken").status_code == 404
    failures = AuditEvent.objects.filter(action="capability.deploy_failed", subject="alice--broken")
    assert failures.count() == 1
    assert "not placed: " + broken["deploy"]["error"]["message"] in versions_shown_to_the_owner(
        admin_client, "alice--broken"
    )
    assert "being placed" not in versions_shown_to_the_owner(admin_client, "alice--later")
    assert AuditEvent.objects.filter(action="capability.created", subject="alice--later").count() == 1
    gone = pool_script_name("alice--gone")
    assert gone not in scripts_on_cloudflare() and uploads(worker_pool, gone) == []


def test_status_never_reports_more_used_slots_than_there_are_and_shows_what_is_paged_out_apart(
    worker_pool, alice, celery_worker
):
    import dataclasses
    import threading

    import requests

    for name in ("a", "b", "c", "d", "e", "f"):
        deploy(alice, name, name, type="normal")
    wait_for(lambda: not Capability.objects.filter(state="evicting").exists(), timeout=30, message="page-outs")
    worker_pool.configure(latency=0.3)  # the victims' deletes take a while: they are seen leaving
    poller = dataclasses.replace(alice, session=requests.Session())
    seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            seen.append(poller.call("/_api/status").json())

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            assert list(pool.map(lambda n: alice.call(f"/alice/{n}").text, "abc")) == ["a", "b", "c"]
        wait_for(lambda: not Capability.objects.filter(state="evicting").exists(), timeout=60, message="page-outs")
    finally:
        stop.set()
        thread.join()
    worker_pool.configure(latency=0)
    assert seen and all(s["used_slots"] <= s["total_slots"] == 3 for s in seen), seen
    assert any(s["paging_out"] > 0 for s in seen)
    final = alice.call("/_api/status").json()
    assert (final["used_slots"], final["paging_out"]) == (3, 0)
