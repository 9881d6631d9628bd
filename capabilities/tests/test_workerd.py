import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import urllib3
from django.conf import settings

from capabilities.runtimes import build_runtime
from capabilities.runtimes.base import CodeBundle, Route
from capabilities.tests.runtimes.contract import HELLO, call
from capabilities.workerd.group import read_status
from capabilities.workerd.host import WorkerdHost, WorkerdMissing, WorkerdPortInUse
from sigil.ports import free_port, free_port_block, port_is_open
from testsupport.processes import children, command_line, is_alive, resident_mb, wait_until


@pytest.fixture
def host(tmp_path):
    """A workerd host of this test's own, on a free port, stopped at the end."""
    host = WorkerdHost(
        binary=settings.SIGIL_WORKERD_BIN,
        port=free_port(),
        code_dir=tmp_path / "code",
        state_dir=tmp_path / "workerd",
        secret="supervisor-test-secret",
    )
    yield host
    host.stop()


@pytest.fixture
def supervised(host):
    """`host` under supervise() in a thread, as runworkerd runs it."""
    stop = threading.Event()
    thread = threading.Thread(target=host.supervise, args=(stop,), daemon=True)
    thread.start()
    wait_until(lambda: host.is_running() and port_is_open(host.port), timeout=10, what="workerd to listen")
    yield host
    stop.set()
    thread.join(10)
    assert not thread.is_alive()


def ok(route) -> bool:
    try:
        return call(route).status == 200
    except urllib3.exceptions.HTTPError:  # refused while workerd starts again
        return False


def test_workerd_killed_by_sigkill_is_restarted_and_serves_the_same_code_again(supervised):
    bundle = CodeBundle.from_code(HELLO)
    supervised.code_dir.mkdir(parents=True, exist_ok=True)
    (supervised.code_dir / f"{bundle.sha}.json").write_bytes(bundle.to_json())
    route = Route(
        base_url=supervised.url,
        headers=(("X-Sigil-Secret", supervised.secret), ("X-Sigil-Loader-Id", f"alice--hello@{bundle.sha}")),
    )
    assert call(route, "/before").data == b"hello /before"
    first_pid = supervised.process.pid

    os.kill(first_pid, signal.SIGKILL)

    wait_until(lambda: supervised.is_running() and supervised.process.pid != first_pid, timeout=5, what="a restart")
    wait_until(lambda: ok(route), timeout=5, what="the capability to answer again")
    assert call(route, "/after").data == b"hello /after"
    assert not is_alive(first_pid)


def test_supervise_stops_workerd_when_asked(host):
    stop = threading.Event()
    thread = threading.Thread(target=host.supervise, args=(stop,), daemon=True)
    thread.start()
    wait_until(host.is_running, timeout=10, what="workerd to start")
    pid = host.process.pid

    stop.set()
    thread.join(10)

    assert not is_alive(pid)
    assert not port_is_open(host.port)


def test_supervising_a_started_host_keeps_its_workerd_and_stops_it(host):
    # As `manage.py cfemulator` does: start (a missing binary is its error), then supervise,
    # whose own start must not wait for the port the first workerd holds, fail, and lose it.
    host.start()
    pid = host.process.pid
    stop = threading.Event()
    thread = threading.Thread(target=host.supervise, args=(stop,), daemon=True)
    thread.start()
    stop.set()
    thread.join(10)
    assert not is_alive(pid)
    assert not port_is_open(host.port)


def test_start_refuses_a_port_that_another_process_holds(host):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", host.port))
        squatter.listen()
        with pytest.raises(WorkerdPortInUse, match=str(host.port)):
            host.start(port_wait_seconds=0.3)
    assert host.process is None


def test_start_waits_for_a_dying_process_to_release_the_port(host):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", host.port))
    squatter.listen()
    threading.Timer(0.3, squatter.close).start()

    host.start(port_wait_seconds=5)

    assert host.is_running()
    assert port_is_open(host.port)


def test_supervise_gives_up_at_once_when_workerd_is_not_installed(host, tmp_path):
    host.binary = str(tmp_path / "no-such-workerd")
    with pytest.raises(WorkerdMissing, match="npm ci"):
        host.supervise(threading.Event())


@pytest.mark.slow
def test_runworkerd_restarts_workerd_and_a_sigterm_stops_even_a_stalled_one_promptly(tmp_path):
    port = free_port_block()
    env = {**os.environ, "SIGIL_VAR_DIR": str(tmp_path), "SIGIL_WORKERD_PORT": str(port), "SIGIL_CPU_MS": "60000"}
    env.pop("SIGIL_CODE_DIR", None)
    # An agent registered by an earlier run: its workerd is started at once.
    (tmp_path / "workerd").mkdir()
    (tmp_path / "workerd" / "ports.json").write_text(json.dumps({"alice": 0}))
    spin = CodeBundle.from_code("export default { async fetch() { while (true) {} } }")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{spin.sha}.json").write_bytes(spin.to_json())
    command = subprocess.Popen(
        [sys.executable, str(settings.BASE_DIR / "manage.py"), "runworkerd"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def workerd_pid() -> int | None:
            pids = [pid for pid in children(command.pid) if "workerd" in command_line(pid)]
            return pids[0] if pids and port_is_open(port) else None

        first = wait_until(workerd_pid, timeout=20, what="runworkerd to start workerd")
        os.kill(first, signal.SIGKILL)

        def restarted_pid() -> int | None:
            pid = workerd_pid()
            return pid if pid != first else None

        second = wait_until(restarted_pid, timeout=5, what="a restart")
        # Stall it: a workerd whose loop spins does not act on SIGTERM.
        headers = {"X-Sigil-Secret": settings.SIGIL_INTERNAL_SECRET, "X-Sigil-Loader-Id": f"alice--spin@{spin.sha}"}

        def spin_call() -> None:
            with contextlib.suppress(urllib3.exceptions.HTTPError):  # cut when workerd is stopped
                urllib3.request("GET", f"http://127.0.0.1:{port}/", headers=headers, retries=False)

        threading.Thread(target=spin_call, daemon=True).start()

        def answers() -> bool:
            try:
                urllib3.request("GET", f"http://127.0.0.1:{port}/", retries=False, timeout=0.3)
                return True
            except urllib3.exceptions.HTTPError:
                return False

        wait_until(lambda: not answers(), timeout=5, what="workerd's loop to stall")

        started = time.monotonic()
        command.send_signal(signal.SIGTERM)
        assert command.wait(10) == 0, command.stdout.read().decode()
        assert time.monotonic() - started < 6
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
    assert not is_alive(second)
    assert not port_is_open(port)


# Holds a few MB of its own, as a capability with a parsed config or a table does.
WITH_STATE = """const table = Array.from({ length: 5000 }, (_, i) => ({ key: "k" + i, value: i }));
export default { async fetch() { return new Response("%s " + table.length) } }"""


def agent_process_mb(runtime, agent: str) -> float:
    """Resident memory of the workerd serving `agent`'s capabilities (each agent has one)."""
    return resident_mb(read_status(runtime.processes.status_path)["processes"][agent]["pid"])


@pytest.mark.slow
def test_workerd_memory_levels_off_under_steady_calls(workerd_group):
    runtime = build_runtime("local")
    bundle = CodeBundle.from_code(HELLO)
    runtime.place(slot="steady--hello", tenant="steady", bundle=bundle)  # an agent, so a process, of its own
    route = runtime.route(slot="steady--hello", tenant="steady", sha=bundle.sha)
    for _ in range(1500):  # the allocator's and the isolates' own start-up growth
        assert call(route).status == 200
    settled = agent_process_mb(runtime, "steady")
    for _ in range(4000):
        assert call(route).status == 200
    # Memory, not time: a loaded machine changes nothing here. Until each collection was a
    # full one, every call left about 13 KB behind: over 50 MB for these calls.
    assert agent_process_mb(runtime, "steady") - settled < 20


@pytest.mark.slow
def test_workerd_memory_levels_off_as_new_versions_replace_old_ones(workerd_group):
    runtime = build_runtime("local")
    slot = "versioned--table"

    def deploy_and_call(version: int) -> None:
        bundle = CodeBundle.from_code(WITH_STATE % version)
        runtime.place(slot=slot, bundle=bundle, tenant="versioned")
        for _ in range(20):
            assert call(runtime.route(slot=slot, sha=bundle.sha, tenant="versioned")).data == f"{version} 5000".encode()

    for version in range(5):
        deploy_and_call(version)
    settled = agent_process_mb(runtime, "versioned")
    for version in range(5, 35):
        deploy_and_call(version)
    # An isolate kept per version would hold over 3 MB each: about 100 MB for these 30.
    assert agent_process_mb(runtime, "versioned") - settled < 30
