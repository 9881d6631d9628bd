import pytest
import urllib3

from capabilities.runtimes import build_runtime
from capabilities.runtimes.base import CodeBundle
from capabilities.tests.runtimes.contract import HELLO, RuntimeContract, call


@pytest.fixture
def runtime(workerd_group):
    return build_runtime("local")


class TestLocalRuntime(RuntimeContract):
    pass


def test_workerd_refuses_requests_without_the_secret(runtime):
    slot = "alice--guarded"
    bundle = CodeBundle.from_code(HELLO)
    runtime.place(slot=slot, bundle=bundle)
    route = runtime.route(slot=slot, sha=bundle.sha)
    response = urllib3.request("GET", route.base_url + "/", headers={"X-Sigil-Loader-Id": f"{slot}@{bundle.sha}"})
    assert response.status == 403
    assert response.headers["x-sigil-error"] == "forbidden"


def test_two_slots_with_the_same_code_share_one_bundle(runtime):
    bundle = CodeBundle.from_code(HELLO.replace("hello", "shared"))
    runtime.place(slot="alice--one", bundle=bundle)
    runtime.place(slot="bob--two", bundle=bundle)
    runtime.remove(slot="alice--one")
    assert call(runtime.route(slot="bob--two", sha=bundle.sha)).data == b"shared /"
    runtime.remove(slot="bob--two")
    assert not (runtime.code_dir / f"{bundle.sha}.json").exists()


def test_new_code_frees_the_bundle_it_replaces_unless_another_slot_uses_it(runtime):
    first, second = CodeBundle.from_code(HELLO.replace("hello", "first")), CodeBundle.from_code(HELLO)
    runtime.place(slot="alice--one", bundle=first)
    runtime.place(slot="bob--two", bundle=first)
    runtime.place(slot="alice--one", bundle=second)
    assert (runtime.code_dir / f"{first.sha}.json").exists()  # bob--two still runs it
    runtime.place(slot="bob--two", bundle=second)
    assert not (runtime.code_dir / f"{first.sha}.json").exists()
    assert call(runtime.route(slot="bob--two", sha=second.sha)).data == b"hello /"


def test_the_supervisor_takes_in_every_agent_with_a_placement(tmp_path):
    from capabilities.runtimes.local import LocalProcesses, local_limits

    (tmp_path / "code" / "slots").mkdir(parents=True)
    for slot in ("alice--one", "alice--two", "bob--three"):
        (tmp_path / "code" / "slots" / slot).write_text("0" * 64)
    processes = LocalProcesses(state_dir=tmp_path / "workerd", base_port=9000)

    processes.group(
        code_dir=tmp_path / "code",
        binary="workerd",
        secret="s",
        limits=local_limits(cpu_ms=1000, memory_mb=512),
        own_session=True,
    )

    assert processes.registry.names() == ["alice", "bob"]
