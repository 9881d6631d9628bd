"""No orphans: whatever kills runsigil or the emulator, what they started ends too, and a
start ends what a hard-killed run left under its var directory before it binds its ports."""

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sigil.embedded_redis import EmbeddedRedis
from sigil.lifetime import PidFiles, group_members
from sigil.ports import free_port, port_is_open
from sigil_site.tests import test_runsigil
from sigil_site.tests.test_runsigil import MANAGE, http_status, runsigil_refused, start_runsigil
from testsupport.capability_code import PONG
from testsupport.cast import AgentClient
from testsupport.processes import command_line, descendants, is_alive, wait_until

embedded_env = test_runsigil.embedded_env


@contextlib.contextmanager
def dead_parent():
    """The pid of a process that has exited, as a killed run's supervisor is, for records made
    as if it had started what they name (its start time is read while it runs)."""
    process = subprocess.Popen(["sleep", "60"])
    try:
        yield process.pid, lambda: (process.kill(), process.wait())
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def record_orphan(pid_files: PidFiles, name: str, pid: int) -> None:
    with dead_parent() as (parent, end_parent):
        pid_files.record(name, pid, parent=parent)
        end_parent()


def leftover_redis(var_dir: Path) -> subprocess.Popen:
    """A redis-server on the var directory's socket that no parent-death signal reaches, as
    a killed run of an older Sigil left it, recorded in the pid file that run would have written."""
    server = EmbeddedRedis(var_dir / "redis", socket_path=var_dir / "redis.sock")
    server.prepare()
    process = subprocess.Popen(server.command(), start_new_session=True)
    wait_until(server.ping, timeout=10, what="the leftover redis-server")
    record_orphan(PidFiles(var_dir / "run"), "redis", process.pid)
    return process


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.slow
def test_a_kill_9_of_runsigils_process_group_leaves_nothing_and_it_starts_again(embedded_env):
    # No runner of this run takes asynchronous calls: accepted, not yet run.
    embedded_env = {**embedded_env, "SIGIL_ASYNC_RUNNERS": "0"}
    var_dir = Path(embedded_env["SIGIL_VAR_DIR"])
    web_port, workerd_port = free_port(), int(embedded_env["SIGIL_WORKERD_PORT"])
    left = leftover_redis(var_dir)
    first, output = start_runsigil(embedded_env, web_port)
    second = None
    old: set[int] = set()
    try:
        wait_until(lambda: output.has("Press Ctrl-C to stop.") or first.poll() is not None, timeout=90)
        assert output.has("ended what a previous run left running: redis"), str(output)
        assert left.wait(5) == -signal.SIGKILL
        old = descendants(first.pid) | {first.pid}
        assert any("workerd serve" in command_line(pid) for pid in old)
        assert any("celery" in command_line(pid) for pid in old)

        tokens = json.loads(
            subprocess.run(
                [sys.executable, MANAGE, "createagent", "alice", "--json"],
                env=embedded_env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        alice = AgentClient("alice", tokens["deploy_token"], tokens["invoke_token"], f"http://127.0.0.1:{web_port}")
        assert alice.deploy(name="ping", code=PONG).status_code == 201
        calls = [alice.call("/alice/ping", headers={"Prefer": "respond-async"}) for _ in range(3)]
        assert [call.status_code for call in calls] == [202] * 3

        os.killpg(first.pid, signal.SIGKILL)  # what `kill -9 -PGID` of `make run` does
        first.wait()
        # Started again at once: what has not yet stopped on the SIGTERM each program got
        # from the kernel is ended by the new start before it binds its ports.
        second, output = start_runsigil(embedded_env, web_port, migrate=False)
        wait_until(lambda: output.has("Press Ctrl-C to stop.") or second.poll() is not None, timeout=90)
        assert second.poll() is None, str(output)
        assert http_status(web_port, "/admin/login/") == 200 and port_is_open(workerd_port)
        assert [command_line(pid) for pid in old if is_alive(pid)] == []
        assert not set(descendants(second.pid)) & old
        # The bundled Redis kept what it acknowledged: every accepted call is still there.
        for call in calls:
            pending = alice.call(call.json()["status_url"])
            assert pending.status_code == 202 and pending.json()["status"] == "accepted", pending.text

        # What it wrote is its owner's only (the admin's collected static files aside, in
        # owner-only directories too).
        written = [p for p in var_dir.rglob("*") if "static" not in p.relative_to(var_dir).parts[:1]]
        assert {p.name for p in written} >= {"sigil.sqlite3", "appendonly.aof", "runsigil.pid", "host.js"}
        for path in written:
            if path.is_dir():
                assert mode(path) == 0o700, path
            elif not path.is_socket():
                assert mode(path) == 0o600, path
        assert mode(var_dir / "static") == 0o700
        second.send_signal(signal.SIGINT)
        assert second.wait(60) == 0, str(output)
    finally:
        for process in (left, first, second):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for pid in old:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_second_runsigil_on_the_same_var_directory_is_refused_not_let_kill_the_first(embedded_env, tmp_path):
    var_dir = Path(embedded_env["SIGIL_VAR_DIR"])
    # A live process recorded as the running supervisor.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        PidFiles(var_dir / "run").record("runsigil", holder.pid)
        result = runsigil_refused(embedded_env, free_port())
        assert result.returncode == 1
        assert f"Sigil already runs on {var_dir} (pid {holder.pid})" in result.stderr
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


def test_leftovers_are_ended_with_their_whole_process_group(tmp_path):
    # A program that ignores SIGTERM and started a child of its own, then lost its parent.
    script = "import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    script += (
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(flush=True); time.sleep(60)"
    )
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE)
    leader.stdout.readline()
    pid_files = PidFiles(tmp_path)
    pid_files.record("alive", leader.pid)  # by this process, which runs: no leftover
    assert pid_files.end_leftovers() == [] and leader.poll() is None
    record_orphan(pid_files, "stubborn", leader.pid)
    members = wait_until(lambda: len(group_members(leader.pid)) == 2 and group_members(leader.pid), timeout=10)
    assert pid_files.end_leftovers() == ["stubborn"]
    assert leader.wait(5) == -signal.SIGKILL
    wait_until(lambda: not any(is_alive(pid) for pid in members), timeout=5, what="the group to end")
    assert not (tmp_path / "stubborn.pid").exists()


def test_a_pid_file_whose_pid_was_given_to_another_process_ends_nothing(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (tmp_path / "old.pid").write_text(f"{other.pid} 1 1 1\n")  # with other start times
        assert PidFiles(tmp_path).end_leftovers() == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_kill_9_of_the_emulator_leaves_no_workerd(tmp_path):
    port, workerd_port = free_port(), free_port()
    emulator = subprocess.Popen(
        [
            sys.executable,
            MANAGE,
            "cfemulator",
            "--port",
            str(port),
            "--workerd-port",
            str(workerd_port),
            "--state-dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: port_is_open(port) or emulator.poll() is not None, timeout=30, what="the emulator")
        workerd = [pid for pid in descendants(emulator.pid) if "workerd" in command_line(pid)]
        assert workerd
        emulator.kill()
        emulator.wait()
        wait_until(lambda: not any(is_alive(pid) for pid in workerd), timeout=5, what="its workerd to end")
        wait_until(lambda: not port_is_open(workerd_port), timeout=5, what="its port to close")
    finally:
        if emulator.poll() is None:
            emulator.kill()
            emulator.wait()


def test_a_workerd_a_killed_run_left_on_its_port_is_ended_before_a_new_one_starts(tmp_path, settings):
    from capabilities.workerd.host import WorkerdHost

    host = WorkerdHost.from_settings(port=free_port(), state_dir=tmp_path / "workerd", code_dir=tmp_path / "code")
    host.start()
    # What a run killed before its parent-death signal took effect leaves: a workerd serving,
    # recorded by a parent that is gone.
    left = host.process
    record_orphan(PidFiles(host.state_dir), host.pid_name, left.pid)
    host.process = None
    again = WorkerdHost.from_settings(port=host.port, state_dir=tmp_path / "workerd", code_dir=tmp_path / "code")
    try:
        again.start(port_wait_seconds=1)
        assert left.wait(5) == -signal.SIGKILL
        assert again.process.pid != left.pid and port_is_open(again.port)
        assert PidFiles(again.state_dir).running(again.pid_name) == again.process.pid
    finally:
        again.stop()
        if left.poll() is None:
            left.kill()
            left.wait()
    assert PidFiles(again.state_dir).running(again.pid_name) is None
