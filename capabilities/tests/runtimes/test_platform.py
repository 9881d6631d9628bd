"""The platform runtime against the Cloudflare emulator: its dispatch Worker (the repo's
`dispatcher.js`) runs on workerd with a working dispatch namespace binding."""

import pytest
import urllib3

from capabilities.runtimes.base import CodeBundle
from capabilities.runtimes.cloudflare import CloudflarePlanRequired
from capabilities.runtimes.platform import PlatformRuntime
from capabilities.tests.runtimes.contract import HELLO, ProvisionedRuntimeContract, call


@pytest.fixture
def runtime(cf_client, cf_emulator_fresh, settings):
    return platform_runtime(cf_client, secret=settings.SIGIL_INTERNAL_SECRET, base=cf_emulator_fresh.url)


def platform_runtime(client, *, secret: str, base: str) -> PlatformRuntime:
    """The runtime on the emulator's `sigil-test` namespace behind `sigil-dispatcher`, as a
    Sigil whose secret is `secret` builds it."""
    return PlatformRuntime(
        client=client, namespace="sigil-test", dispatcher="sigil-dispatcher", secret=secret, cpu_ms=50, invoke_base=base
    )


class TestPlatformRuntime(ProvisionedRuntimeContract):
    pass


def test_capabilities_are_namespace_scripts_named_by_full_name_and_tagged(runtime, cf_client):
    runtime.place(slot=runtime.slot_for("alice--hello"), tenant="alice", bundle=CodeBundle.from_code(HELLO))
    assert runtime.slot_for("alice--hello") == "alice--hello"
    assert [s.id for s in cf_client.namespace_script_list("sigil-test", tags=["agent-alice:yes"])] == ["alice--hello"]
    assert cf_client.namespace_get("sigil-test")["script_count"] == 1
    # One account Worker, however many capabilities.
    assert [s.id for s in cf_client.script_list()] == ["sigil-dispatcher"]


def test_provisioning_is_idempotent(runtime, cf_emulator_fresh):
    first = runtime.provision()
    assert first == [
        "created the dispatch namespace sigil-test",
        f"deployed the dispatch Worker sigil-dispatcher ({runtime.dispatcher.version})",
    ]
    uploads = len(cf_emulator_fresh.api_calls(method="PUT"))
    assert runtime.provision() == []
    assert len(cf_emulator_fresh.api_calls(method="PUT")) == uploads


def test_a_fresh_account_gets_its_namespace_whatever_code_says_it_is_missing(runtime, cf_emulator_fresh):
    # No source gives the code of a missing namespace: provisioning reads any 404 as missing.
    cf_emulator_fresh.configure(namespace_not_found_code=10090)
    assert runtime.provision()[0] == "created the dispatch namespace sigil-test"
    runtime.place(slot="alice--hello", tenant="alice", bundle=CodeBundle.from_code(HELLO))
    assert runtime.list_slots() == ["alice--hello"]  # the name Cloudflare nests in script.id


def test_an_account_without_workers_for_platforms_is_told_so(runtime, cf_emulator_fresh):
    cf_emulator_fresh.configure(workers_for_platforms=False)
    with pytest.raises(CloudflarePlanRequired, match="Workers for Platforms subscription"):
        runtime.provision()
    assert cf_emulator_fresh.api_calls(method="POST") == []  # it did not try to create the namespace


def test_a_missing_script_in_the_namespace_is_a_404_sigil_reads_as_a_miss(runtime):
    runtime.provision()
    response = call(runtime.route(slot="alice--never-placed", tenant="alice", sha="0" * 64))
    assert response.status == 404
    assert response.headers["x-sigil-error"] == "missing-code"
    assert runtime.is_missing(response)


def test_the_capabilitys_own_404_is_not_a_miss(runtime):
    bundle = CodeBundle.from_code("export default { fetch() { return new Response('nope', { status: 404 }) } }")
    runtime.place(slot="alice--own404", tenant="alice", bundle=bundle)
    response = call(runtime.route(slot="alice--own404", tenant="alice", sha=bundle.sha))
    assert (response.status, response.data) == (404, b"nope")
    assert not runtime.is_missing(response)


def test_the_dispatch_worker_refuses_calls_without_sigils_secret(runtime, cf_emulator_fresh):
    runtime.place(slot="alice--guarded", tenant="alice", bundle=CodeBundle.from_code(HELLO))
    route = runtime.route(slot="alice--guarded", tenant="alice", sha="")
    headers = {"Host": route.host_header, "X-Sigil-Script": "alice--guarded"}
    for secret in (None, "wrong"):
        sent = {**headers, **({"X-Sigil-Dispatch-Secret": secret} if secret else {})}
        response = urllib3.request("GET", route.base_url + "/", headers=sent)
        assert response.status == 403 and response.headers["x-sigil-error"] == "forbidden"
    assert [d["script"] for d in cf_emulator_fresh.dispatches()] == []  # nothing was dispatched


def test_the_cpu_limit_reaches_the_dispatch_namespace_binding(runtime, cf_emulator_fresh):
    bundle = CodeBundle.from_code(HELLO)
    runtime.place(slot="alice--limited", tenant="alice", bundle=bundle)
    call(runtime.route(slot="alice--limited", tenant="alice", sha=bundle.sha))
    call(runtime.route(slot="alice--limited", tenant="alice", sha=bundle.sha, cpu_ms=7))
    assert [d["limits"] for d in cf_emulator_fresh.dispatches()] == [{"cpuMs": 50}, {"cpuMs": 7}]


def test_check_fails_until_the_dispatch_worker_is_deployed_and_current(runtime, cf_client):
    from capabilities.runtimes.base import RuntimeUnavailable

    with pytest.raises(RuntimeUnavailable, match="deployruntime"):
        runtime.check()
    runtime.provision()
    runtime.check()
    stale = platform_runtime(cf_client, secret="another-secret", base=runtime.dispatcher.invoke_base)
    stale.dispatcher.version = "0" * 16
    with pytest.raises(RuntimeUnavailable, match="runs version"):
        stale.check()


def test_long_full_names_get_a_hashed_script_name_within_one_dns_label(runtime):
    full = "a" * 31 + "--" + "b" * 41
    slot = runtime.slot_for(full)
    assert len(slot) <= 63 and slot != runtime.slot_for(full, attempt=1)
    bundle = CodeBundle.from_code(HELLO)
    runtime.place(slot=slot, tenant="a" * 31, bundle=bundle)
    assert call(runtime.route(slot=slot, tenant="a" * 31, sha=bundle.sha)).data == b"hello /"


def test_a_rotated_secret_deploys_the_dispatch_worker_again(runtime, cf_client, settings):
    runtime.provision()
    rotated = platform_runtime(cf_client, secret="rotated-secret", base=runtime.dispatcher.invoke_base)
    assert rotated.dispatcher.version != runtime.dispatcher.version
    assert rotated.provision() == [f"deployed the dispatch Worker sigil-dispatcher ({rotated.dispatcher.version})"]
    bundle = CodeBundle.from_code(HELLO)
    rotated.place(slot="alice--rotated", tenant="alice", bundle=bundle)
    assert call(rotated.route(slot="alice--rotated", tenant="alice", sha=bundle.sha)).data == b"hello /"
    assert call(runtime.route(slot="alice--rotated", tenant="alice", sha=bundle.sha)).status == 403
