"""The generic workerd supervision (capabilities.workerd) on real workerd processes."""

import http.client
import os
import signal
import threading
import time

import pytest
from django.conf import settings

from capabilities.runtimes.base import CodeBundle
from capabilities.workerd.group import PortRegistry, WorkerdGroup, read_status
from capabilities.workerd.host import WorkerdHost, WorkerdMissing
from capabilities.workerd.supervision import KillLog, Limits
from sigil.ports import free_port_block
from testsupport.capability_code import PONG
from testsupport.processes import is_alive, wait_until

SECRET = "supervision-test-secret"
SPIN = "export default { async fetch() { while (true) {} } }"
HOG = "export default { async fetch() { const kept = []; while (true) kept.push(new Uint8Array(64 << 20).fill(1)) } }"
# The allocation reaches 200 MB well before 1.5 s even on a loaded machine, so it is stopped
# for its memory rather than for stalling the loop while it allocates.
LIMITS = Limits(stall_ms=1500, memory_mb=200)


@pytest.fixture
def group(tmp_path):
    """A group of two names' workerd processes, supervised in a thread, as runworkerd runs it."""
    code_dir = tmp_path / "code"

    def make_host(name: str, port: int) -> WorkerdHost:
        return WorkerdHost(
            binary=settings.SIGIL_WORKERD_BIN, port=port, code_dir=code_dir, state_dir=tmp_path / name, secret=SECRET
        )

    registry = PortRegistry(tmp_path / "ports.json", base_port=free_port_block())
    group = WorkerdGroup(
        make_host, LIMITS, registry, kill_log=KillLog(tmp_path / "kills"), status_path=tmp_path / "status.json"
    )
    stop = threading.Event()
    thread = threading.Thread(target=group.run, args=(stop,), daemon=True)
    thread.start()
    yield group
    stop.set()
    thread.join(15)
    assert not thread.is_alive()


def place(group: WorkerdGroup, code: str) -> str:
    bundle = CodeBundle.from_code(code)
    code_dir = next(iter(group.processes.values())).host.code_dir
    code_dir.mkdir(parents=True, exist_ok=True)
    (code_dir / f"{bundle.sha}.json").write_bytes(bundle.to_json())
    return bundle.sha


def call(port: int, sha: str, *, timeout: float = 30) -> tuple[int | None, float]:
    """(status, seconds); status None when the connection was dropped."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    try:
        connection.request("GET", "/", headers={"X-Sigil-Secret": SECRET, "X-Sigil-Loader-Id": f"cap@{sha}"})
        response = connection.getresponse()
        response.read()
        return response.status, time.monotonic() - started
    except (OSError, http.client.HTTPException):
        return None, time.monotonic() - started
    finally:
        connection.close()


def keep_calling(port: int, sha: str, stop: threading.Event, results: list) -> None:
    while not stop.is_set():
        results.append(call(port, sha, timeout=10)[0])
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize(("code", "reason"), [(SPIN, "cpu"), (HOG, "memory")])
def test_a_runaway_process_is_killed_and_replaced_while_its_neighbour_keeps_answering(group, code, reason):
    runaway_port, other_port = group.ensure("runaway"), group.ensure("other")
    runaway_sha, pong_sha = place(group, code), place(group, PONG)
    first_pid = group.get("runaway").host.process.pid
    results: list = []
    stop = threading.Event()
    neighbour = threading.Thread(target=keep_calling, args=(other_port, pong_sha, stop, results))
    neighbour.start()
    try:
        sent_at = time.time()
        status, seconds = call(runaway_port, runaway_sha)
        assert status is None  # the connection dropped: the process was killed under it
        assert seconds < LIMITS.stall_ms / 1000 + 2.5, seconds  # generous for a loaded machine

        kill = KillLog(group.kill_log.directory).latest("runaway")
        assert kill is not None and kill.reason == reason and kill.pid == first_pid
        assert kill.blames(sent_at)
        assert not kill.blames(kill.at + 1)  # a call sent after the kill is innocent
        wait_until(lambda: not is_alive(first_pid), timeout=2, what="the killed process to be gone")

        port = wait_until(lambda: group.get("runaway").serving() and group.get("runaway").port, timeout=3)
        assert port == runaway_port  # same port: routes that callers cached stay valid
        assert call(runaway_port, pong_sha)[0] == 200
    finally:
        stop.set()
        neighbour.join(15)
    assert results and all(status == 200 for status in results), results


def test_the_registry_keeps_each_names_port_across_instances(tmp_path):
    first = PortRegistry(tmp_path / "ports.json", base_port=9000)
    assert (first.port_for("alice"), first.port_for("bob"), first.port_for("alice")) == (9000, 9001, 9000)
    again = PortRegistry(tmp_path / "ports.json", base_port=9000)
    assert (again.port_for("bob"), again.port_for("carol")) == (9001, 9002)
    assert again.names() == ["alice", "bob", "carol"]


def test_the_status_file_lists_each_process(group, tmp_path):
    group.ensure("listed")

    def listed() -> dict | None:
        status = read_status(tmp_path / "status.json")
        entry = status and status["processes"].get("listed")
        return entry if entry and entry["state"] == "serving" else None

    entry = wait_until(listed, timeout=3, what="the process in the status file")
    assert entry["port"] == group.get("listed").port
    assert entry["pid"] == group.get("listed").host.process.pid


@pytest.mark.slow
def test_a_stalled_process_yields_the_cpu_and_stopping_the_group_kills_it_promptly(tmp_path):
    code_dir = tmp_path / "code"
    group = WorkerdGroup(
        lambda name, port: WorkerdHost(
            binary=settings.SIGIL_WORKERD_BIN, port=port, code_dir=code_dir, state_dir=tmp_path, secret=SECRET
        ),
        Limits(stall_ms=60_000, memory_mb=1000),  # the watchdog would not step in
        PortRegistry(tmp_path / "ports.json", base_port=free_port_block()),
    )
    stop = threading.Event()
    thread = threading.Thread(target=group.run, args=(stop,), daemon=True)
    thread.start()
    port = group.ensure("stuck")
    pid = group.get("stuck").host.process.pid
    threading.Thread(target=call, args=(port, place(group, SPIN)), daemon=True).start()
    wait_until(lambda: call(port, "0" * 64, timeout=0.3)[0] is None, timeout=5, what="the loop to stall")
    # Spinning, it yields the CPU to every other process until it is stopped.
    wait_until(lambda: os.getpriority(os.PRIO_PROCESS, pid) == 19, timeout=3, what="the process to be niced")

    started = time.monotonic()
    stop.set()
    thread.join(15)

    assert not thread.is_alive()
    assert time.monotonic() - started < 6
    assert not is_alive(pid)


def test_a_process_the_host_does_not_run_is_not_taken_for_a_runaway(tmp_path):
    """Silent without using the CPU (stopped by SIGSTOP here, as a host too busy to run it
    leaves it): past its stall limit it is not stopped for CPU, nor reniced; much later it is
    stopped as starved, and no call of it is blamed."""
    limits = Limits(stall_ms=300, memory_mb=1000)
    code_dir = tmp_path / "code"
    group = WorkerdGroup(
        lambda name, port: WorkerdHost(
            binary=settings.SIGIL_WORKERD_BIN, port=port, code_dir=code_dir, state_dir=tmp_path, secret=SECRET
        ),
        limits,
        PortRegistry(tmp_path / "ports.json", base_port=free_port_block()),
        kill_log=KillLog(tmp_path / "kills"),
    )
    stop = threading.Event()
    thread = threading.Thread(target=group.run, args=(stop,), daemon=True)
    thread.start()
    try:
        port = group.ensure("starved")
        pong = place(group, PONG)
        assert call(port, pong)[0] == 200
        pid = group.get("starved").host.process.pid
        sent_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        time.sleep(3 * limits.stall_ms / 1000)
        assert group.kill_log.latest("starved") is None  # silent, but not spinning
        assert os.getpriority(os.PRIO_PROCESS, pid) == 0

        kill = wait_until(lambda: group.kill_log.latest("starved"), timeout=10, what="the starved process's stop")
        assert kill.reason == "starved" and kill.pid == pid
        assert not kill.blames(sent_at) and not kill.blames(kill.at - 0.1)
        assert "too busy" in kill.describe()
        wait_until(lambda: call(port, pong, timeout=1)[0] == 200, timeout=10, what="a fresh process")
    finally:
        stop.set()
        thread.join(15)


def test_a_process_killed_from_outside_is_restarted_on_its_port_without_a_kill_record(group):
    port = group.ensure("crashed")
    sha = place(group, PONG)
    first_pid = group.get("crashed").host.process.pid

    os.kill(first_pid, signal.SIGKILL)

    wait_until(lambda: group.get("crashed").snapshot()["pid"] not in (None, first_pid), timeout=5, what="a restart")
    wait_until(lambda: call(port, sha)[0] == 200, timeout=5, what="the process to answer again")
    assert group.kill_log.latest("crashed") is None  # it died on its own: no limit was passed


def test_supervision_gives_up_at_once_when_workerd_is_not_installed(tmp_path):
    group = WorkerdGroup(
        lambda name, port: WorkerdHost(
            binary=str(tmp_path / "no-such-workerd"), port=port, code_dir=tmp_path, state_dir=tmp_path, secret=SECRET
        ),
        LIMITS,
        PortRegistry(tmp_path / "ports.json", base_port=free_port_block()),
    )
    group.registry.port_for("someone")
    with pytest.raises(WorkerdMissing, match="npm ci"):
        group.run(threading.Event())


def test_an_agent_with_nothing_placed_any_more_has_its_workerd_stopped_until_its_next_placement(tmp_path):
    from capabilities.runtimes.local import LocalProcesses, LocalRuntime, local_limits

    processes = LocalProcesses(state_dir=tmp_path / "workerd", base_port=free_port_block(), idle_after_seconds=1.0)
    code_dir = tmp_path / "code"
    group = processes.group(
        code_dir=code_dir,
        binary=settings.SIGIL_WORKERD_BIN,
        secret=SECRET,
        limits=local_limits(cpu_ms=1000, memory_mb=500),
        own_session=False,
    )
    stop = threading.Event()
    thread = threading.Thread(target=group.run, args=(stop,), daemon=True)
    thread.start()
    runtime = LocalRuntime(code_dir=code_dir, processes=processes, secret=SECRET)
    try:
        wait_until(lambda: read_status(processes.status_path), timeout=10, what="the supervisor's status")
        for tenant, slot in (("alice", "alice--kept"), ("bob", "bob--gone")):
            runtime.place(slot=slot, bundle=CodeBundle.from_code(PONG), tenant=tenant)
        bob_pid = group.get("bob").host.process.pid
        alice_pid = group.get("alice").host.process.pid

        runtime.remove(slot="bob--gone")  # bob's last capability: removed (or bob deleted)
        wait_until(lambda: not is_alive(bob_pid), timeout=10, what="bob's workerd to stop")
        assert group.get("bob") is None
        # The status is written twice a second: the next one no longer names bob.
        wait_until(
            lambda: "bob" not in read_status(processes.status_path)["processes"], timeout=5, what="bob's status gone"
        )
        time.sleep(1.5)  # past the idle time and a check: alice's has a placement, it runs on
        assert is_alive(alice_pid) and group.get("alice").host.process.pid == alice_pid

        runtime.place(slot="bob--back", tenant="bob", bundle=CodeBundle.from_code(PONG))  # started again for it
        assert group.get("bob").serving()
        assert runtime.list_slots() == ["alice--kept", "bob--back"]
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive() and not is_alive(alice_pid)
