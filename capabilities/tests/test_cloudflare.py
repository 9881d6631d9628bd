"""The Cloudflare client against the emulator over real HTTP, with the real (test) Redis."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.core.exceptions import ImproperlyConfigured

from capabilities.runtimes.cloudflare import (
    CloudflareAuthFailure,
    CloudflareClient,
    CloudflareNotFound,
    CloudflarePlanRequired,
    CloudflareRateLimited,
    CloudflareRejected,
    CloudflareScriptTooLarge,
    CloudflareSlotsExhausted,
    CloudflareUnavailable,
    upload_parts,
)
from capabilities.runtimes.errors import RuntimeRejected, RuntimeUnavailable, ScriptTooLarge, SlotsExhausted
from sigil.ports import free_port
from testsupport.emulator import namespace_upload

HELLO = "export default { async fetch(request) { return new Response('hello ' + new URL(request.url).pathname) } }"


def upload(client: CloudflareClient, name: str, code: str = HELLO, **kwargs):
    return client.script_upload(
        name, modules={"worker.js": code}, main_module="worker.js", compatibility_date="2025-01-01", **kwargs
    )


def make_client(emulator, redis_client, **overrides) -> CloudflareClient:
    options = {
        "base_url": emulator.api_base,
        "account_id": emulator.account_id,
        "api_token": emulator.token,
        "redis": redis_client,
        "max_retries": 4,
        "max_rate_wait_seconds": 10.0,
        "backoff_base_seconds": 0.01,
        "backoff_max_seconds": 0.1,
        **overrides,
    }
    return CloudflareClient(**options)


# --- scripts ------------------------------------------------------------------------------------


def test_upload_list_serve_delete_then_404(cf_client, cf_emulator_fresh):
    info = upload(cf_client, "hello-client")
    assert info.id == "hello-client" and len(info.etag) == 64 and info.created_on
    assert [s.id for s in cf_client.script_list()] == ["hello-client"]
    assert cf_client.script_subdomain_set("hello-client") == {"enabled": True, "previews_enabled": False}
    subdomain = cf_client.subdomain_get()
    host = f"hello-client.{subdomain}.workers.dev"
    served = cf_emulator_fresh.worker_request(host, "/there")
    assert (served.status_code, served.text) == (200, "hello /there")

    cf_client.script_delete("hello-client")
    assert cf_emulator_fresh.worker_request(host).status_code == 404
    assert cf_client.script_list() == []
    with pytest.raises(CloudflareNotFound) as missing:
        cf_client.script_delete("hello-client")
    assert missing.value.code == 10007 and missing.value.status == 404


def test_upload_sends_metadata_as_the_reference_lays_it_out(cf_client):
    bindings = [
        {"type": "plain_text", "name": "GREETING", "text": "hi"},
        {"type": "secret_text", "name": "KEY", "text": "s3cr3t"},
    ]
    upload(cf_client, "meta", bindings=bindings, tags=["sigil", "s-abc123"], limits={"cpu_ms": 50})
    settings = cf_client.script_settings_get("meta")
    assert settings["tags"] == ["sigil", "s-abc123"]
    assert settings["limits"] == {"cpu_ms": 50}
    assert settings["compatibility_date"] == "2025-01-01"
    assert [b["name"] for b in settings["bindings"]] == ["GREETING", "KEY"]


def test_upload_parts_put_metadata_first_as_a_plain_field_and_type_each_module():
    parts = upload_parts(
        modules={"worker.js": "export default {}", "data.txt": "x"},
        main_module="worker.js",
        compatibility_date="2025-01-01",
    )
    assert parts[0][0] == "metadata" and parts[0][1][0] is None
    assert parts[1] == ("worker.js", ("worker.js", b"export default {}", "application/javascript+module"))
    assert parts[2][1][2] == "text/plain"
    with pytest.raises(ValueError, match="not among the modules"):
        upload_parts(modules={"a.js": ""}, main_module="b.js", compatibility_date="2025-01-01")


def test_script_quota_is_slots_exhausted_not_retried_and_never_exceeded(cf_client, cf_emulator_fresh):
    cf_emulator_fresh.configure(script_limit=3)
    outcomes: list[str] = []

    def attempt(i: int) -> None:
        try:
            upload(cf_client, f"slot-{i}")
            outcomes.append("placed")
        except CloudflareSlotsExhausted as exc:
            # In a worker thread, where pytest.raises cannot wrap the call.
            assert isinstance(exc, SlotsExhausted) and exc.code == 10037  # noqa: PT017
            outcomes.append("full")

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(attempt, range(8)))
    assert sorted(outcomes) == ["full"] * 5 + ["placed"] * 3
    assert len(cf_client.script_list()) == 3
    # A permanent refusal is sent once, not retried.
    assert len(cf_emulator_fresh.api_calls(method="PUT")) == 8


def test_script_too_large_is_script_too_large(cf_client, cf_emulator_fresh):
    cf_emulator_fresh.configure(script_max_bytes=1024)
    with pytest.raises(CloudflareScriptTooLarge) as too_large:
        upload(cf_client, "huge", HELLO + "//" + os.urandom(4096).hex())
    assert isinstance(too_large.value, ScriptTooLarge) and too_large.value.code == 10027
    assert cf_client.script_list() == []


def test_invalid_code_layout_is_rejected_for_good(cf_client):
    with pytest.raises(CloudflareRejected) as rejected:
        upload(cf_client, "Bad_Name")
    assert isinstance(rejected.value, RuntimeRejected) and rejected.value.code == 10016


# --- auth and routing -----------------------------------------------------------------------------


def test_bad_token_is_auth_failure_and_the_token_is_never_shown(cf_emulator_fresh, redis_client, caplog):
    secret = "not-the-right-token-9f8e7d"
    client = make_client(cf_emulator_fresh, redis_client, api_token=secret)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(CloudflareAuthFailure) as failure:
        client.script_list()
    assert failure.value.code == 10000 and failure.value.status == 403
    assert secret not in str(failure.value)
    assert secret not in repr(failure.value)
    assert secret not in repr(client)
    assert secret not in caplog.text
    # Authentication failures are permanent: one call, no retries.
    assert len(cf_emulator_fresh.api_calls()) == 1


def test_wrong_account_is_rejected_with_7003(cf_emulator_fresh, redis_client):
    client = make_client(cf_emulator_fresh, redis_client, account_id="0000")
    with pytest.raises(CloudflareRejected) as rejected:
        client.script_list()
    assert rejected.value.code == 7003


def test_from_settings_reads_the_edge_settings(cf_settings, redis_client):
    cf_settings.SIGIL_CF_RATE_LIMIT = 7
    client = CloudflareClient.from_settings()
    assert client.budget.limit == 7
    assert client.script_list() == []
    cf_settings.CF_API_TOKEN = ""
    with pytest.raises(ImproperlyConfigured):
        CloudflareClient.from_settings()


# --- retries ----------------------------------------------------------------------------------------


def test_injected_5xx_are_retried_and_the_call_is_served(cf_client, cf_emulator_fresh):
    cf_emulator_fresh.configure(fail_next=3)  # a 500 envelope, a 502 HTML page, a 503
    info = upload(cf_client, "after-faults")
    assert info.id == "after-faults"
    statuses = [call["status"] for call in cf_emulator_fresh.api_calls(method="PUT")]
    assert statuses == [500, 502, 503, 200]


def test_retries_are_bounded_and_end_in_unavailable(cf_emulator_fresh, redis_client):
    client = make_client(cf_emulator_fresh, redis_client, max_retries=2)
    cf_emulator_fresh.configure(fail_next=10)
    with pytest.raises(CloudflareUnavailable) as unavailable:
        client.script_list()
    assert isinstance(unavailable.value, RuntimeUnavailable)
    assert len(cf_emulator_fresh.api_calls()) == 3


def test_connection_errors_are_retried_then_unavailable(cf_emulator_fresh, redis_client):
    client = make_client(cf_emulator_fresh, redis_client, max_retries=1)
    client.base_url = f"http://127.0.0.1:{free_port()}/client/v4"  # nothing listens there
    with pytest.raises(CloudflareUnavailable) as unavailable:
        client.script_list()
    assert unavailable.value.status is None
    assert cf_emulator_fresh.token not in str(unavailable.value)


def spend_elsewhere(emulator, calls: int = 1) -> None:
    """API calls on the same token from outside Sigil (the owner's dashboard, their scripts):
    they draw on Cloudflare's limit, and Sigil never sees their Ratelimit headers."""
    url = f"{emulator.api_base}/accounts/{emulator.account_id}/workers/scripts"
    for _ in range(calls):
        requests.get(url, headers={"Authorization": f"Bearer {emulator.token}"}, timeout=10)


def test_cloudflare_429_is_waited_out_with_retry_after_then_served(cf_client, cf_emulator_fresh):
    cf_emulator_fresh.configure(rate_limit="3/1")
    started = time.monotonic()
    cf_client.script_list()
    spend_elsewhere(cf_emulator_fresh, 2)
    cf_client.script_list()
    elapsed = time.monotonic() - started
    statuses = [(call["status"], call["code"]) for call in cf_emulator_fresh.api_calls()]
    assert statuses == [(200, None)] * 3 + [(429, 971), (200, None)]
    assert 1.0 <= elapsed < 3.0


def test_ratelimit_headers_pause_the_shared_budget_before_cloudflare_locks_out(cf_emulator_fresh, redis_client):
    # Cloudflare's `Ratelimit: "default";r=0;t=30` on the third answer says the window is
    # spent: the fourth call is not made (it would lock the token out for the whole window).
    client = make_client(cf_emulator_fresh, redis_client, max_rate_wait_seconds=0.5)
    cf_emulator_fresh.configure(rate_limit="3/30")
    for _ in range(3):
        client.script_list()
    started = time.monotonic()
    with pytest.raises(CloudflareRateLimited) as limited:
        client.script_list()
    assert time.monotonic() - started < 0.5
    assert 25 < limited.value.retry_after <= 30
    assert [call["status"] for call in cf_emulator_fresh.api_calls()] == [200, 200, 200]
    assert 25_000 < redis_client.pttl(client.budget.pause_key) <= 30_000  # every process waits


def test_a_tighter_ratelimit_policy_than_configured_is_adopted(cf_emulator_fresh, redis_client):
    client = make_client(cf_emulator_fresh, redis_client, rate_limit=1000, rate_window_seconds=300)
    client.script_list()  # the emulator's policy is Cloudflare's 1200 per 300 s: looser, kept
    assert (client.budget.limit, client.budget.window_ms) == (1000, 300_000)
    cf_emulator_fresh.configure(rate_limit="50/60")
    client.script_list()
    assert (client.budget.limit, client.budget.window_ms) == (50, 60_000)


def test_a_delete_answered_without_a_body_is_done(cf_client, cf_emulator_fresh):
    cf_emulator_fresh.configure(empty_delete_answers=True)
    upload(cf_client, "gone")
    assert cf_client.script_delete("gone") is None
    assert cf_client.script_list() == []
    assert [call["status"] for call in cf_emulator_fresh.api_calls(method="DELETE")] == [200]


def test_retry_after_beyond_the_allowed_wait_is_raised_as_rate_limited(cf_emulator_fresh, redis_client):
    client = make_client(cf_emulator_fresh, redis_client, max_rate_wait_seconds=0.5)
    cf_emulator_fresh.configure(rate_limit="1/30")
    spend_elsewhere(cf_emulator_fresh)
    started = time.monotonic()
    with pytest.raises(CloudflareRateLimited) as limited:
        client.script_list()
    assert time.monotonic() - started < 0.5
    assert limited.value.code == 971 and limited.value.retry_after == 30
    assert isinstance(limited.value, RuntimeUnavailable)


# A second process: the one thing it shares with the test is Redis. It calls once, allowed to
# wait up to 20 s for room, and prints how long it waited before its call was answered.
OTHER_PROCESS = """
import sys, time, redis
from capabilities.runtimes.cloudflare import CloudflareClient
base, account, token, redis_url = sys.argv[1:5]
client = CloudflareClient(base_url=base, account_id=account, api_token=token,
                          redis=redis.Redis.from_url(redis_url), max_rate_wait_seconds=20.0)
started = time.monotonic()
client.script_list()
print(time.monotonic() - started)
"""


def test_a_lockout_longer_than_the_allowed_wait_still_pauses_every_process(cf_emulator_fresh, redis_client, settings):
    # Cloudflare's lockout (Retry-After: 3 here, 300 s on a real account) is longer than this
    # client may wait: it gives up, but first pauses the shared budget, so another process
    # waits the lockout out instead of calling into it.
    client = make_client(cf_emulator_fresh, redis_client, max_rate_wait_seconds=0.5)
    cf_emulator_fresh.configure(rate_limit="1/3")
    spend_elsewhere(cf_emulator_fresh)
    with pytest.raises(CloudflareRateLimited):
        client.script_list()
    assert 2000 < redis_client.pttl(client.budget.pause_key) <= 3000
    emulator = cf_emulator_fresh
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            OTHER_PROCESS,
            emulator.api_base,
            emulator.account_id,
            emulator.token,
            settings.REDIS_URL,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    statuses = [call["status"] for call in cf_emulator_fresh.api_calls()]
    assert statuses == [200, 429, 200]  # the other process never called into the lockout
    assert float(other.stdout) > 1.0  # it waited (most of the 3 s; its start-up took the rest)


def test_the_default_budget_leaves_cloudflares_limit_a_margin(cf_emulator_fresh, redis_client):
    client = CloudflareClient(
        base_url=cf_emulator_fresh.api_base,
        account_id=cf_emulator_fresh.account_id,
        api_token=cf_emulator_fresh.token,
        redis=redis_client,
    )
    assert client.budget.limit < 1200 and client.budget.window_ms == 300_000


# --- the shared rate budget --------------------------------------------------------------------------


def test_shared_budget_queues_a_burst_across_clients_instead_of_failing(cf_emulator_fresh, redis_client):
    # Two clients stand for two processes: they share nothing but Redis. The emulator enforces
    # the same limit, so a single call over budget would be a 429.
    cf_emulator_fresh.configure(rate_limit="5/2")
    clients = [make_client(cf_emulator_fresh, redis_client, rate_limit=5, rate_window_seconds=2) for _ in range(2)]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=10) as pool:
        results = list(pool.map(lambda i: clients[i % 2].script_list(), range(10)))
    elapsed = time.monotonic() - started
    assert results == [[]] * 10
    calls = cf_emulator_fresh.api_calls()
    assert len(calls) == 10 and {call["status"] for call in calls} == {200}
    assert 1.9 <= elapsed < 4.0
    # The second five started only as the first five left the window.
    times = sorted(call["time"] for call in calls)
    assert times[5] - times[0] >= 1.9


def test_exhausted_budget_fails_fast_when_room_is_further_than_the_wait(cf_emulator_fresh, redis_client):
    client = make_client(
        cf_emulator_fresh, redis_client, rate_limit=1, rate_window_seconds=5, max_rate_wait_seconds=0.2
    )
    client.script_list()
    with pytest.raises(CloudflareRateLimited) as limited:
        client.script_list()
    assert 4.0 < limited.value.retry_after <= 5.0
    assert len(cf_emulator_fresh.api_calls()) == 1  # the refused call never reached Cloudflare


# --- dispatch namespaces and KV -------------------------------------------------------------------------


def test_dispatch_namespace_scripts_round_trip(cf_client, cf_emulator_fresh):
    created = cf_client.namespace_create("sigil-ns")
    assert created["namespace_name"] == "sigil-ns"
    assert [ns["namespace_name"] for ns in cf_client.namespace_list()] == ["sigil-ns"]
    namespace_upload(cf_client, "sigil-ns", "alice--ping", code=HELLO, tags=["agent-alice"])
    namespace_upload(cf_client, "sigil-ns", "bob--pong", code=HELLO, tags=["agent-bob"])
    assert cf_client.namespace_get("sigil-ns")["script_count"] == 2
    assert [s.id for s in cf_client.namespace_script_list("sigil-ns", tags=["agent-alice:yes"])] == ["alice--ping"]
    served = cf_emulator_fresh.worker_request(cf_emulator_fresh.dispatch_host("sigil-ns", "alice--ping"), "/a")
    assert served.text == "hello /a"
    cf_client.namespace_script_delete("sigil-ns", "alice--ping")
    with pytest.raises(CloudflareNotFound):
        cf_client.namespace_script_delete("sigil-ns", "alice--ping")
    cf_client.namespace_delete("sigil-ns")
    with pytest.raises(CloudflareNotFound):
        cf_client.namespace_get("sigil-ns")


def test_an_empty_name_never_reaches_cloudflare(cf_client, cf_emulator_fresh):
    with pytest.raises(CloudflareRejected, match="empty name"):
        cf_client.namespace_script_delete("sigil-ns", "")
    with pytest.raises(CloudflareRejected, match="empty name"):
        cf_client.script_delete("")
    assert cf_emulator_fresh.api_calls() == []


@pytest.mark.parametrize("code", [10007, 10090])
def test_a_missing_namespace_is_not_found_whatever_its_code(cf_client, cf_emulator_fresh, code):
    # No public source gives Cloudflare's code for a missing dispatch namespace: a 404 is read
    # as not found with 10007 and with any other code.
    cf_emulator_fresh.configure(namespace_not_found_code=code)
    with pytest.raises(CloudflareNotFound) as missing:
        cf_client.namespace_get("sigil-absent")
    assert (missing.value.status, missing.value.code) == (404, code)
    with pytest.raises(CloudflareNotFound):
        cf_client.namespace_script_list("sigil-absent")


def test_a_404_for_a_wrong_route_is_not_read_as_not_found(cf_emulator_fresh, redis_client):
    # 7003 "No route for the URI" says the API base (or account) is wrong, not that a thing is missing.
    client = make_client(cf_emulator_fresh, redis_client, base_url=cf_emulator_fresh.api_base + "/v0")
    with pytest.raises(CloudflareRejected) as wrong:
        client.namespace_get("sigil")
    assert wrong.value.status == 404 and wrong.value.code == 7003
    assert not isinstance(wrong.value, CloudflareNotFound)


def test_a_duplicate_namespace_is_rejected_with_400(cf_client):
    cf_client.namespace_create("sigil-ns")
    with pytest.raises(CloudflareRejected) as duplicate:
        cf_client.namespace_create("sigil-ns")
    assert duplicate.value.status == 400 and not isinstance(duplicate.value, CloudflareNotFound)


def test_a_kv_binding_to_a_missing_namespace_is_10042_in_plain_words(cf_client):
    with pytest.raises(CloudflareRejected) as refused:
        upload(cf_client, "reads-kv", bindings=[{"type": "kv_namespace", "name": "STORE", "namespace_id": "0" * 32}])
    assert refused.value.code == 10042
    assert "KV binding names a KV namespace the account lacks" in str(refused.value)


def test_a_free_account_refuses_a_worker_loader_binding_as_a_plan_error(cf_client, cf_emulator_fresh):
    cf_emulator_fresh.configure(plan="free")
    with pytest.raises(CloudflarePlanRequired) as refused:
        upload(cf_client, "loads", bindings=[{"type": "worker_loader", "name": "LOADER"}])
    assert refused.value.code == 10021 and isinstance(refused.value, RuntimeRejected)
    assert "needs the Workers Paid plan" in str(refused.value)
    assert "binding LOADER of type worker_loader is invalid" in str(refused.value)
    # Any other validation failure stays a plain rejection.
    with pytest.raises(CloudflareRejected) as invalid:
        upload(cf_client, "broken", bindings=[{"type": "teleporter", "name": "T"}])
    assert not isinstance(invalid.value, CloudflarePlanRequired)


def test_an_account_without_workers_for_platforms_is_a_plan_error(cf_client, cf_emulator_fresh):
    cf_emulator_fresh.configure(workers_for_platforms=False)
    with pytest.raises(CloudflarePlanRequired) as refused:
        cf_client.namespace_get("sigil")
    assert "need a Workers for Platforms subscription" in str(refused.value)
    assert not isinstance(refused.value, CloudflareNotFound)  # provisioning must not try to create it


def test_kv_values_round_trip(cf_client):
    namespace = cf_client.kv_namespace_create("sigil-code")
    assert [ns["title"] for ns in cf_client.kv_namespace_list()] == ["sigil-code"]
    cf_client.kv_put(namespace["id"], "code:a/b?c", b"\x00bundle")
    assert cf_client.kv_get(namespace["id"], "code:a/b?c") == b"\x00bundle"
    cf_client.kv_put(namespace["id"], "ttl", b"short-lived", expiration_ttl=60)
    cf_client.kv_delete(namespace["id"], "code:a/b?c")
    cf_client.kv_delete(namespace["id"], "code:a/b?c")  # deleting a missing key succeeds
    with pytest.raises(CloudflareNotFound) as missing:
        cf_client.kv_get(namespace["id"], "code:a/b?c")
    assert missing.value.code == 10009
    with pytest.raises(CloudflareRejected):
        cf_client.kv_namespace_create("sigil-code")


def test_kv_keys_are_listed_with_their_metadata(cf_client):
    namespace = cf_client.kv_namespace_create("sigil-code")["id"]
    cf_client.kv_put(namespace, "slot:alice--ping", b"abc", metadata={"sha": "abc"})
    cf_client.kv_put(namespace, "slot:bob--pong", b"def", metadata={"sha": "def"})
    cf_client.kv_put(namespace, "code:abc", b"{}")
    assert cf_client.kv_get(namespace, "slot:alice--ping") == b"abc"
    assert cf_client.kv_keys(namespace, prefix="slot:") == [
        {"name": "slot:alice--ping", "metadata": {"sha": "abc"}},
        {"name": "slot:bob--pong", "metadata": {"sha": "def"}},
    ]
    cf_client.kv_put(namespace, "slot:alice--ping", b"ghi")  # a write without metadata drops it
    assert cf_client.kv_keys(namespace, prefix="slot:alice")[0] == {"name": "slot:alice--ping"}


def test_kv_bulk_writes_and_deletes_take_as_few_requests_as_cloudflares_10000_pairs_allow(cf_client, cf_emulator_fresh):
    from capabilities.runtimes.cloudflare import KvPair

    namespace = cf_client.kv_namespace_create("sigil-edge")["id"]
    pairs = [KvPair(f"k{n:05}", f"v{n}".encode()) for n in range(20_001)]
    pairs[0] = KvPair("k00000", b"\xff\x00", expiration_ttl=3600, metadata={"sha": "x"})  # not UTF-8: base64
    assert cf_client.kv_bulk_put(namespace, pairs) == []
    assert len(cf_emulator_fresh.api_calls(method="PUT", path_suffix="/bulk")) == 3
    assert cf_client.kv_get(namespace, "k00000") == b"\xff\x00"
    assert cf_client.kv_get(namespace, "k20000") == b"v20000"
    listed = cf_client.kv_keys(namespace, prefix="k0000")
    assert listed[0]["metadata"] == {"sha": "x"} and listed[0]["expiration"] > time.time() + 3500

    assert cf_client.kv_bulk_delete(namespace, [pair.key for pair in pairs[:15_000]]) == []
    assert len(cf_emulator_fresh.api_calls(method="POST", path_suffix="/bulk/delete")) == 2
    assert len(cf_client.kv_keys(namespace)) == 5_001


def test_a_kv_namespace_of_sigils_is_found_once_for_every_process_and_again_once_gone(
    cf_client, cf_emulator_fresh, redis_client
):
    from capabilities.runtimes.cloudflare import KvPair, NamedKv

    def listings() -> int:
        return len(cf_emulator_fresh.api_calls(method="GET", path_suffix="/storage/kv/namespaces"))

    kv = NamedKv(client=cf_client, title="sigil-things")
    first = kv.id  # created, as the account had none of that title
    assert kv.provision() is False
    seen = listings()
    another_process = make_client(cf_emulator_fresh, redis_client)
    try:
        assert NamedKv(client=another_process, title="sigil-things").id == first
    finally:
        another_process.close()
    assert listings() == seen

    gone = requests.delete(
        f"{cf_emulator_fresh.api_base}/accounts/{cf_emulator_fresh.account_id}/storage/kv/namespaces/{first}",
        headers={"Authorization": f"Bearer {cf_emulator_fresh.token}"},
        timeout=10,
    )
    assert gone.status_code == 200
    with pytest.raises(CloudflareNotFound):
        kv.bulk_put([KvPair("k", b"v")])
    assert kv.id != first
    assert [ns["title"] for ns in cf_client.kv_namespace_list()] == ["sigil-things"]


def test_a_runtime_that_does_not_answer_is_said_in_words(redis_client, cf_emulator):
    """The error names the address and the OS's reason, not urllib3's objects."""
    import socket

    from capabilities.runtimes.cloudflare.errors import CloudflareUnavailable

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = make_client(cf_emulator, redis_client, base_url=f"http://127.0.0.1:{port}/client/v4", max_retries=0)
    with pytest.raises(CloudflareUnavailable) as caught:
        client.script_list()
    message = str(caught.value)
    assert f"127.0.0.1:{port}: Connection refused" in message
    assert "object at 0x" not in message and "urllib3" not in message
