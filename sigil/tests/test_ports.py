"""Two checkouts side by side with only PORT set: every other port follows from it (or is
chosen free) and is recorded under SIGIL_VAR_DIR, where every command reads it."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests
from django.conf import settings

from sigil import ports
from sigil.ports import free_port_block, port_is_open
from sigil_site.tests.test_runsigil import Output, launch_runsigil
from testsupport.capability_code import PONG
from testsupport.processes import descendants, is_alive, wait_until

MANAGE = str(settings.BASE_DIR / "manage.py")


def checkout_env() -> dict[str, str]:
    """`make run`'s environment in a checkout of its own: nothing set but its var directory
    (which stands for the checkout's own var/)."""
    var_dir = Path(tempfile.mkdtemp(prefix="sigil-port-"))  # short: the Redis socket path
    env = {**os.environ, "SIGIL_VAR_DIR": str(var_dir), "PYTHONUNBUFFERED": "1"}
    for inherited in ("REDIS_URL", "SIGIL_CODE_DIR", "SIGIL_OWNER_PASSWORD", "DATABASE_URL", "SIGIL_WORKERD_PORT",
                      "CF_EMULATOR_PORT"):  # fmt: skip
        env.pop(inherited, None)
    return env


def manage(env: dict[str, str], *args: str) -> str:
    return subprocess.run([sys.executable, MANAGE, *args], env=env, check=True, capture_output=True, text=True).stdout


@pytest.mark.slow
def test_two_sigils_with_different_ports_run_side_by_side():
    base = free_port_block(count=820)  # room for two PORTs and the ports derived from them
    webs = [base, base + 10]
    envs = [checkout_env() for _ in webs]
    started: list[tuple[subprocess.Popen, Output]] = []
    try:
        for env, web in zip(envs, webs, strict=True):
            manage(env, "migrate", "--verbosity", "0")
            started.append(launch_runsigil(env, web))
        for process, output in started:
            wait_until(lambda p=process, o=output: o.has("Press Ctrl-C to stop.") or p.poll() is not None, timeout=90)
            assert process.poll() is None, str(output)

        for env, web in zip(envs, webs, strict=True):
            recorded = ports.recorded(Path(env["SIGIL_VAR_DIR"]))
            assert recorded == {"web": web, "workerd": web + 788, "cfemulator": web + 787}
            # Any command on this var directory reads the same ports as the running processes.
            read = manage(env, "shell", "-c", "from django.conf import settings; print(settings.SIGIL_WORKERD_PORT)")
            assert int(read.split()[-1]) == recorded["workerd"]

            assert requests.get(f"http://127.0.0.1:{web}/_health", timeout=30).json()["status"] == "ok"
            agent = json.loads(manage(env, "createagent", "alice", "--json"))
            deployed = requests.post(
                f"http://127.0.0.1:{web}/_api/deploy",
                json={"name": "ping", "code": PONG},
                headers={"Authorization": f"Bearer {agent['deploy_token']}"},
                timeout=60,
            )
            assert deployed.status_code == 201, deployed.text
            called = requests.get(
                f"http://127.0.0.1:{web}/alice/ping",
                headers={"Authorization": f"Bearer {agent['invoke_token']}"},
                timeout=60,
            )
            assert (called.status_code, called.text) == (200, "pong")
            assert port_is_open(recorded["workerd"])  # alice's workerd, of this checkout
    finally:
        children = set()
        for process, _ in started:
            children |= descendants(process.pid)
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process, output in started:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            output.thread.join(5)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not any(is_alive(pid) for pid in children), timeout=5)
        for pid in children:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for env in envs:
            shutil.rmtree(env["SIGIL_VAR_DIR"], ignore_errors=True)


def test_a_derived_port_taken_by_something_else_is_replaced_and_kept(tmp_path):
    import socket

    base = free_port_block(count=800)
    with socket.socket() as squatter:  # something else holds what PORT's workerd port would be
        squatter.bind(("127.0.0.1", base + 788))
        squatter.listen()
        chosen = ports.ports_choose(web=base, var_dir=tmp_path, workerd_count=8)
        assert chosen.workerd != base + 788 and chosen.cfemulator == base + 787
        ports.record(tmp_path, chosen)
        again = ports.ports_choose(web=base, var_dir=tmp_path, workerd_count=8)
        assert again == chosen  # the one chosen before, while the derived one is still taken
    assert ports.ports_choose(web=base, var_dir=tmp_path, workerd_count=8).workerd == base + 788
    fixed = ports.ports_choose(web=base, var_dir=tmp_path, workerd_count=8, workerd_fixed=4000, emulator_fixed=4100)
    assert (fixed.workerd, fixed.cfemulator) == (4000, 4100)


HELLO_CONFIG = """using Workerd = import "/workerd/workerd.capnp";
const config :Workerd.Config = (
  services = [ (name = "main", worker = .hello) ],
  sockets = [ (name = "http", address = "127.0.0.1:{port}", http = (), service = "main") ],
);
const hello :Workerd.Worker = (
  modules = [ (name = "hello.js", esModule = "export default {{ fetch() {{ return new Response('hello') }} }}") ],
  compatibilityDate = "2025-01-01",
);
"""


def test_a_held_port_is_given_to_no_one_else_and_workerd_serves_on_it_across_restarts(tmp_path):
    held = ports.HeldPort()
    try:
        # No other program binds it, as a server that picked it (or a port "free" a moment ago) would,
        # and the kernel gives it to no one asking for a free port.
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", held.port))
        others = [ports.HeldPort() for _ in range(50)]
        assert held.port not in {port.port for port in others}
        for port in others:
            port.close()
        assert not port_is_open(held.port)  # nothing answers before its server listens

        config = tmp_path / "hello.capnp"
        config.write_text(HELLO_CONFIG.format(port=held.port))
        for _ in range(2):  # started, stopped and started again on the same port
            workerd = subprocess.Popen(
                [settings.SIGIL_WORKERD_BIN, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            try:
                wait_until(lambda: port_is_open(held.port), timeout=15)
                assert requests.get(f"http://127.0.0.1:{held.port}/", timeout=10).text == "hello"
            finally:
                workerd.terminate()
                workerd.wait(10)
            with socket.socket() as other, pytest.raises(OSError, match="in use"):
                other.bind(("127.0.0.1", held.port))  # still held while its server is down
    finally:
        held.close()
