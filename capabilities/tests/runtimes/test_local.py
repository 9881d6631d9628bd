import time

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
    runtime.place(slot=slot, tenant="alice", bundle=bundle)
    route = runtime.route(slot=slot, tenant="alice", sha=bundle.sha)
    response = urllib3.request("GET", route.base_url + "/", headers={"X-Sigil-Loader-Id": f"{slot}@{bundle.sha}"})
    assert response.status == 403
    assert response.headers["x-sigil-error"] == "forbidden"


def test_two_slots_with_the_same_code_share_one_bundle(runtime):
    bundle = CodeBundle.from_code(HELLO.replace("hello", "shared"))
    runtime.place(slot="alice--one", tenant="alice", bundle=bundle)
    runtime.place(slot="bob--two", tenant="bob", bundle=bundle)
    runtime.remove(slot="alice--one")
    assert call(runtime.route(slot="bob--two", tenant="bob", sha=bundle.sha)).data == b"shared /"
    runtime.remove(slot="bob--two")
    assert not (runtime.code_dir / f"{bundle.sha}.json").exists()


def test_new_code_frees_the_bundle_it_replaces_unless_another_slot_uses_it(runtime):
    first, second = CodeBundle.from_code(HELLO.replace("hello", "first")), CodeBundle.from_code(HELLO)
    runtime.place(slot="alice--one", tenant="alice", bundle=first)
    runtime.place(slot="bob--two", tenant="bob", bundle=first)
    runtime.place(slot="alice--one", tenant="alice", bundle=second)
    assert (runtime.code_dir / f"{first.sha}.json").exists()  # bob--two still runs it
    runtime.place(slot="bob--two", tenant="bob", bundle=second)
    assert not (runtime.code_dir / f"{first.sha}.json").exists()
    assert call(runtime.route(slot="bob--two", tenant="bob", sha=second.sha)).data == b"hello /"


def supervisor_started(tmp_path):
    """The local runtime's processes under `tmp_path`, once the supervisor's group is made
    (which takes in the agents with placements in `tmp_path / "code"`)."""
    from capabilities.runtimes.local import LocalProcesses, local_limits

    processes = LocalProcesses(state_dir=tmp_path / "workerd", base_port=9000)
    processes.group(
        code_dir=tmp_path / "code",
        binary="workerd",
        secret="s",
        limits=local_limits(cpu_ms=1000, memory_mb=512),
        own_session=True,
    )
    return processes


def test_the_supervisor_takes_in_every_agent_with_a_placement(tmp_path):
    (tmp_path / "code" / "slots").mkdir(parents=True)
    for slot in ("alice--one", "alice--two", "bob--three"):
        (tmp_path / "code" / "slots" / slot).write_text("0" * 64)
    processes = supervisor_started(tmp_path)

    assert processes.registry.names() == ["alice", "bob"]


def test_placements_are_filed_under_the_tenant_they_are_given_not_read_from_the_slot(tmp_path):
    from capabilities.runtimes.local import Placements

    placements = Placements(tmp_path / "code")
    pointer = placements.pointer(slot="alice--borrowed", tenant="carol")  # no slot names carol
    pointer.parent.mkdir(parents=True)
    pointer.write_text("0" * 64)
    processes = supervisor_started(tmp_path)

    assert processes.registry.names() == ["carol"]
    assert placements.find("alice--borrowed") == pointer
    assert processes.idle(["alice", "carol"], code_dir=tmp_path / "code") == {"alice"}


def test_placements_removed_while_they_are_listed_are_no_error(tmp_path):
    """The supervisor lists the placements every second; an agent's directory removed in the
    middle of a listing must not raise (it would end the supervisor and every process)."""
    import shutil
    import threading

    from capabilities.runtimes.local import Placements

    placements = Placements(tmp_path / "code")
    stop = threading.Event()

    def place_and_remove_all():
        while not stop.is_set():
            for index in range(20):
                pointer = placements.pointer(slot=f"agent{index}--one", tenant=f"agent{index}")
                pointer.parent.mkdir(parents=True, exist_ok=True)
                pointer.write_text("0" * 64)
            shutil.rmtree(placements.root, ignore_errors=True)

    churn = threading.Thread(target=place_and_remove_all)
    churn.start()
    try:
        seen = set()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # tens of these listings race a removal each second
            seen |= placements.tenants()
    finally:
        stop.set()
        churn.join()
    assert seen <= {f"agent{index}" for index in range(20)} and seen  # it did list some


# Counts its calls in module state, which lives as long as its isolate does.
COUNTER = "let calls = 0; export default { async fetch() { return new Response('%s ' + ++calls) } }"


def test_workerd_keeps_a_slots_two_latest_versions_loaded_and_releases_older_ones(runtime):
    slot = "alice--counted"
    one, two, three = (CodeBundle.from_code(COUNTER % version) for version in ("one", "two", "three"))
    runtime.place(slot=slot, tenant="alice", bundle=one)
    assert call(runtime.route(slot=slot, tenant="alice", sha=one.sha)).data == b"one 1"
    runtime.place(slot=slot, tenant="alice", bundle=two)
    assert call(runtime.route(slot=slot, tenant="alice", sha=two.sha)).data == b"two 1"
    runtime.place(slot=slot, tenant="alice", bundle=three)  # its start check loads it: a third version

    # The previous version still answers calls routed to it before the switch, from the
    # isolate it ran in (its bundle is already deleted)...
    assert not (runtime.code_dir / f"{two.sha}.json").exists()
    assert call(runtime.route(slot=slot, tenant="alice", sha=two.sha)).data == b"two 2"
    # ...while the one before it was released: nothing answers for it any more.
    gone = call(runtime.route(slot=slot, tenant="alice", sha=one.sha))
    assert (gone.status, gone.headers["x-sigil-error"]) == (404, "missing-code")
    assert call(runtime.route(slot=slot, tenant="alice", sha=three.sha)).data == b"three 1"


def test_removing_a_slot_releases_its_isolate(runtime):
    slot, bundle = "alice--released", CodeBundle.from_code(COUNTER % "released")
    runtime.place(slot=slot, tenant="alice", bundle=bundle)
    route = runtime.route(slot=slot, tenant="alice", sha=bundle.sha)
    assert [call(route).data for _ in range(2)] == [b"released 1", b"released 2"]
    runtime.remove(slot=slot)
    runtime.place(slot=slot, tenant="alice", bundle=bundle)
    assert call(route).data == b"released 1"  # a fresh isolate: the old one was let go


def test_a_slot_removed_and_placed_again_with_the_same_code_serves_it_every_time(runtime):
    """A released isolate, or a load that failed while the code was gone, is never what the
    same code placed again reaches: it loads afresh each time."""
    slot, bundle = "alice--again", CodeBundle.from_code(COUNTER % "again")
    route = runtime.route(slot=slot, tenant="alice", sha=bundle.sha)
    for _ in range(3):
        runtime.place(slot=slot, tenant="alice", bundle=bundle)
        assert call(route).data == b"again 1"
        runtime.remove(slot=slot)
        gone = call(route)  # the code is gone with the slot: a miss, for Sigil to place it again
        assert (gone.status, gone.headers["x-sigil-error"]) == (404, "missing-code")


def test_code_keeps_its_own_exports_and_cannot_take_the_hosts_release_entrypoint(runtime):
    slot = "alice--exports"
    code = """import { WorkerEntrypoint } from "cloudflare:workers";
export default class extends WorkerEntrypoint { async fetch() { return new Response('class ' + ++globalThis.n) } }
export const SigilRetire = { async fetch() { return new Response('taken') } };
globalThis.n = 0;"""
    bundle = CodeBundle.from_code(code)
    runtime.place(slot=slot, tenant="alice", bundle=bundle)
    route = runtime.route(slot=slot, tenant="alice", sha=bundle.sha)
    assert call(route).data == b"class 1"
    runtime.remove(slot=slot)  # the host's SigilRetire ran, not the capability's
    runtime.place(slot=slot, tenant="alice", bundle=bundle)
    assert call(route).data == b"class 1"
