"""The loader runtime end to end: Sigil over HTTP, code in the emulator's Workers KV, run by
the repo's loader host deployed as a Worker with a Worker Loader."""

from capabilities.models import Capability
from capabilities.runtimes import get_runtime
from testsupport.capability_code import PONG


def test_a_deploy_writes_the_bundle_to_kv_and_the_loader_worker_runs_it(loader, alice, cf_client):
    alice.deploy(name="ping", code=PONG)
    capability = Capability.objects.get(full_name="alice--ping")
    runtime = get_runtime()
    keys = {k["name"] for k in cf_client.kv_keys(runtime.kv_id)}
    assert keys == {f"code:{capability.placed_sha}", "slot:alice--ping"}
    assert alice.call("/alice/ping").text == "pong"
    assert [s.id for s in cf_client.script_list()] == ["sigil-loader"]
