"""The platform runtime end to end: Sigil's REST API and gateway over HTTP, the emulator's
dispatch namespace behind the repo's dispatch Worker."""

from capabilities import services
from capabilities.models import Capability
from capabilities.runtimes import get_runtime
from capabilities.runtimes.cloudflare.account import installation_tag
from testsupport.capability_code import PONG
from testsupport.emulator import namespace_upload


def test_each_capability_gets_its_cpu_limit_through_the_dispatch_worker(platform, alice, settings):
    settings.SIGIL_CPU_MS = 200
    alice.deploy(name="ping", code=PONG)
    assert alice.call("/alice/ping").text == "pong"
    services.capability_set_cpu_limit(
        capability=Capability.objects.get(full_name="alice--ping"), cpu_ms=15, actor="owner:test"
    )
    assert alice.call("/alice/ping").text == "pong"
    assert [d["limits"] for d in platform.dispatches()] == [{"cpuMs": 200}, {"cpuMs": 15}]


def test_a_cpu_limit_out_of_cloudflares_range_is_refused(platform, alice):
    import pytest

    from sigil.errors import InvalidRequest

    alice.deploy(name="ping", code=PONG)
    with pytest.raises(InvalidRequest):
        services.capability_set_cpu_limit(
            capability=Capability.objects.get(full_name="alice--ping"), cpu_ms=300_001, actor="owner:test"
        )


def test_processes_starting_together_deploy_the_dispatch_worker_once(platform, db):
    from concurrent.futures import ThreadPoolExecutor

    from capabilities.runtimes import build_runtime

    runtimes = [build_runtime("platform") for _ in range(8)]  # as eight processes would each hold
    with ThreadPoolExecutor(len(runtimes)) as pool:
        said = list(pool.map(lambda runtime: runtime.provision(), runtimes))
    assert len(platform.api_calls(method="PUT", path_suffix="/scripts/sigil-dispatcher")) == 1
    assert sum("deployed the dispatch Worker sigil-dispatcher" in line for lines in said for line in lines) == 1


def test_status_has_no_slot_limit_and_no_pager(platform, alice):
    alice.deploy(name="ping", code=PONG)
    status = alice.call("/_api/status").json()
    assert status == {**status, "backend": "platform", "total_slots": None, "lru_enabled": False}


def test_reconcile_leaves_the_owners_scripts_in_the_namespace_alone_even_tagged_sigil(
    platform, alice, cf_client, settings
):
    alice.deploy(name="ping", code=PONG)
    namespace = get_runtime().namespace
    namespace_upload(cf_client, namespace, "owners-own", code=PONG, tags=["sigil", "agent-owner"])
    # One this installation left behind (its placement's worker died before recording it).
    left = ["sigil", installation_tag(settings.SIGIL_INTERNAL_SECRET)]
    namespace_upload(cf_client, namespace, "alice--left", code=PONG, tags=left)
    assert services.capability_reconcile()["orphans_removed"] == 1
    assert sorted(s.id for s in cf_client.namespace_script_list(namespace)) == ["alice--ping", "owners-own"]
    assert services.capability_reconcile()["orphans_removed"] == 0
    assert alice.call("/alice/ping").text == "pong"
