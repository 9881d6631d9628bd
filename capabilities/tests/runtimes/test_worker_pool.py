import pytest

from capabilities.runtimes.worker_pool import WorkerPoolRuntime
from capabilities.tests.runtimes.contract import RuntimeContract


@pytest.fixture
def runtime(cf_client, cf_emulator_fresh, settings):
    return WorkerPoolRuntime(
        client=cf_client,
        secret=settings.SIGIL_INTERNAL_SECRET,
        total_quota=500,
        system_reserved=5,
        user_reserved=50,
        safety_margin=5,
        invoke_base=cf_emulator_fresh.url,
    )


class TestWorkerPoolRuntime(RuntimeContract):
    pass


def test_a_pooled_script_refuses_calls_without_sigils_secret(runtime, cf_emulator_fresh):
    from capabilities.runtimes.base import CodeBundle
    from capabilities.tests.runtimes.contract import HELLO

    slot = runtime.slot_for("alice--guarded")
    runtime.place(slot=slot, tenant="alice", bundle=CodeBundle.from_code(HELLO))
    direct = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host(slot))
    assert direct.status_code == 403


def test_only_sigils_scripts_are_listed(runtime, cf_client):
    from capabilities.runtimes.base import CodeBundle
    from capabilities.tests.runtimes.contract import HELLO

    cf_client.script_upload(
        "owners-own-site", modules={"main.js": HELLO}, main_module="main.js", compatibility_date="2025-01-01"
    )
    runtime.place(slot=runtime.slot_for("alice--x"), tenant="alice", bundle=CodeBundle.from_code(HELLO))
    assert runtime.list_slots() == [runtime.slot_for("alice--x")]


def test_slots_are_the_quota_less_reserved_and_margin(runtime):
    assert runtime.total_slots == 440 and runtime.safety_margin == 5


def test_each_script_is_uploaded_with_its_cpu_limit(runtime, cf_client):
    from capabilities.runtimes.base import CodeBundle
    from capabilities.tests.runtimes.contract import HELLO

    own, default = runtime.slot_for("alice--own"), runtime.slot_for("alice--default")
    runtime.place(slot=own, tenant="alice", bundle=CodeBundle.from_code(HELLO, cpu_ms=50))
    runtime.place(slot=default, tenant="alice", bundle=CodeBundle.from_code(HELLO))
    assert cf_client.script_settings_get(own)["limits"] == {"cpu_ms": 50}
    assert cf_client.script_settings_get(default)["limits"] == {}  # no default: Cloudflare's own
    runtime.default_cpu_ms = 700
    runtime.place(slot=default, tenant="alice", bundle=CodeBundle.from_code(HELLO))
    assert cf_client.script_settings_get(default)["limits"] == {"cpu_ms": 700}
