"""The loader runtime against the Cloudflare emulator: its loader Worker (the repo's
`host.js`) runs on workerd with a working Worker Loader and a KV binding served by the
emulator's KV store."""

import pytest
import urllib3

from capabilities.runtimes.base import CodeBundle, ResolvedBinding
from capabilities.runtimes.cloudflare import CloudflarePlanRequired
from capabilities.runtimes.errors import RuntimeRejected
from capabilities.runtimes.loader import LoaderRuntime
from capabilities.tests.runtimes.contract import HELLO, ProvisionedRuntimeContract, call


@pytest.fixture
def runtime(cf_client, cf_emulator_fresh, settings):
    return LoaderRuntime(
        client=cf_client,
        worker="sigil-loader",
        kv_title="sigil-code-test",
        secret=settings.SIGIL_INTERNAL_SECRET,
        cpu_ms=50,
        invoke_base=cf_emulator_fresh.url,
    )


class TestLoaderRuntime(ProvisionedRuntimeContract):
    pass


def test_code_is_content_addressed_in_kv_and_the_slot_points_at_it(runtime, cf_client, settings):
    bundle = CodeBundle.from_code(HELLO)
    runtime.place(slot="alice--one", tenant="alice", bundle=bundle)
    runtime.place(slot="bob--two", tenant="bob", bundle=bundle)
    keys = {k["name"]: k.get("metadata") for k in cf_client.kv_keys(runtime.kv_id)}
    pointer = {"sha": bundle.sha}
    assert keys == {f"code:{bundle.sha}": None, "slot:alice--one": pointer, "slot:bob--two": pointer}
    stored = bundle.to_json(seal_key=settings.SIGIL_INTERNAL_SECRET)  # no secrets: the same each time
    assert cf_client.kv_get(runtime.kv_id, f"code:{bundle.sha}") == stored
    runtime.remove(slot="alice--one")
    assert call(runtime.route(slot="bob--two", tenant="bob", sha=bundle.sha)).data == b"hello /"
    runtime.remove(slot="bob--two")
    assert cf_client.kv_keys(runtime.kv_id) == []
    assert [s.id for s in cf_client.script_list()] == ["sigil-loader"]


def test_the_loader_id_is_the_full_name_at_the_sha(runtime):
    bundle = CodeBundle.from_code(HELLO)
    route = runtime.route(slot="alice--hello", tenant="alice", sha=bundle.sha)
    assert dict(route.headers)["X-Sigil-Loader-Id"] == f"alice--hello@{bundle.sha}"


def test_text_bindings_reach_env_and_nothing_else_does(runtime):
    code = "export default { fetch(r, env) { return Response.json(Object.keys(env).sort()) } }"
    bundle = CodeBundle.from_code(code, bindings=[ResolvedBinding("VAR", "GREETING", "hi")])
    runtime.place(slot="alice--env", tenant="alice", bundle=bundle)
    assert call(runtime.route(slot="alice--env", tenant="alice", sha=bundle.sha)).json() == ["GREETING"]
    assert runtime.binding_kinds == {"VAR", "SECRET"}


def test_code_missing_from_kv_is_a_miss(runtime, cf_client):
    runtime.provision()
    never_stored = CodeBundle.from_code(HELLO)
    response = call(runtime.route(slot="alice--lost", tenant="alice", sha=never_stored.sha))
    assert response.status == 404 and runtime.is_missing(response)


def test_a_placement_survives_the_miss_workers_kv_cached_where_the_host_runs(runtime, cf_emulator_fresh):
    # A call that reached the host before the bundle was written (a page-in racing a call, a
    # location the write had not reached): Cloudflare keeps that "not found" up to 60 s,
    # even for the API's write that follows. The placement stores it through the host.
    assert cf_emulator_fresh.config()["kv_miss_cache_seconds"] == 60
    runtime.provision()
    bundle = CodeBundle.from_code(HELLO)
    route = runtime.route(slot="alice--raced", tenant="alice", sha=bundle.sha)
    assert runtime.is_missing(call(route))  # the miss is cached now
    runtime.place(slot="alice--raced", tenant="alice", bundle=bundle)
    assert call(route).data == b"hello /"
    stores = [c for c in cf_emulator_fresh.api_calls(method="PUT") if "/values/code" in c["path"]]
    assert len(stores) == 1  # the API's write: the host's own went through its binding


def test_code_that_does_not_start_leaves_no_bundle_in_kv(runtime, cf_client):
    with pytest.raises(RuntimeRejected):
        runtime.place(slot="alice--broken", tenant="alice", bundle=CodeBundle.from_code("export default {"))
    assert [key["name"] for key in cf_client.kv_keys(runtime.kv_id, prefix="code:")] == []


def test_the_loader_worker_refuses_calls_without_sigils_secret(runtime):
    bundle = CodeBundle.from_code(HELLO)
    runtime.place(slot="alice--guarded", tenant="alice", bundle=bundle)
    route = runtime.route(slot="alice--guarded", tenant="alice", sha=bundle.sha)
    headers = {"Host": route.host_header, "X-Sigil-Loader-Id": f"alice--guarded@{bundle.sha}"}
    response = urllib3.request("GET", route.base_url + "/", headers=headers)
    assert response.status == 403 and response.headers["x-sigil-error"] == "forbidden"


def test_a_free_account_is_told_the_loader_needs_the_workers_paid_plan(runtime, cf_emulator_fresh):
    cf_emulator_fresh.configure(plan="free")
    with pytest.raises(CloudflarePlanRequired, match="needs the Workers Paid plan"):
        runtime.provision()


def test_provisioning_creates_the_kv_namespace_once_and_is_idempotent(runtime, cf_client, cf_emulator_fresh):
    done = runtime.provision()
    assert done[0].startswith("created the KV namespace sigil-code-test")
    assert done[1] == f"deployed the loader Worker sigil-loader ({runtime.worker.version})"
    puts = len(cf_emulator_fresh.api_calls(method="PUT"))
    assert runtime.provision() == []
    assert len(cf_emulator_fresh.api_calls(method="PUT")) == puts
    assert [ns["title"] for ns in cf_client.kv_namespace_list()] == ["sigil-code-test"]


def test_new_code_frees_the_bundle_it_replaces_unless_another_slot_uses_it(runtime, cf_client):
    def stored():
        return {key["name"] for key in cf_client.kv_keys(runtime.kv_id, prefix="code:")}

    first, second = CodeBundle.from_code(HELLO.replace("hello", "first")), CodeBundle.from_code(HELLO)
    runtime.place(slot="alice--one", tenant="alice", bundle=first)
    runtime.place(slot="bob--two", tenant="bob", bundle=first)
    runtime.place(slot="alice--one", tenant="alice", bundle=second)
    assert stored() == {f"code:{first.sha}", f"code:{second.sha}"}  # bob--two still runs the first
    runtime.place(slot="bob--two", tenant="bob", bundle=second)
    assert stored() == {f"code:{second.sha}"}
    assert call(runtime.route(slot="bob--two", tenant="bob", sha=second.sha)).data == b"hello /"


def test_a_runaway_dynamic_worker_is_stopped_at_its_cpu_limit_not_its_loader_workers(runtime):
    # The runtime gives each call 50 ms; the loader Worker's own limit is the plan's 30 s.
    import time

    runtime.provision()
    spin = CodeBundle.from_code("export default { async fetch() { while (true) {} } }")
    hello = CodeBundle.from_code(HELLO)
    runtime.place(slot="alice--spin", tenant="alice", bundle=spin)
    runtime.place(slot="bob--hello", tenant="bob", bundle=hello)
    started = time.monotonic()
    stopped = call(runtime.route(slot="alice--spin", tenant="alice", sha=spin.sha))
    assert time.monotonic() - started < 3
    # As on Cloudflare, the Dynamic Worker's limit throws into the loader Worker, which says so.
    assert (stopped.status, stopped.headers.get("x-sigil-error")) == (500, "exceeded-cpu"), stopped.data
    assert b"ran past its CPU limit of 50 ms" in stopped.data
    assert call(runtime.route(slot="bob--hello", tenant="bob", sha=hello.sha)).data == b"hello /"
