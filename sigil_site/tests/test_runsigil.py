import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import redis
import requests
from django.conf import settings
from django.contrib.auth.hashers import check_password

from sigil.ports import free_port, free_port_block, port_is_open
from sigil_site.management.commands.runsigil import runtimes_served, sigil_programs
from testsupport.cast import AgentClient
from testsupport.processes import command_line, descendants, is_alive, wait_until
from testsupport.servers import deploy_and_echo_chunked

MANAGE = str(settings.BASE_DIR / "manage.py")


@pytest.fixture
def embedded_env():
    """The environment of `make run` with nothing set: SQLite and the bundled Redis under a
    var directory of its own (not migrated yet), free ports."""
    # Short, because the Redis socket's path must fit in a unix socket address.
    var_dir = Path(tempfile.mkdtemp(prefix="sigil-run-"))
    env = {
        **os.environ,
        "SIGIL_VAR_DIR": str(var_dir),
        "SIGIL_WORKERD_PORT": str(free_port_block()),
        "DATABASE_URL": f"sqlite:///{var_dir / 'sigil.sqlite3'}",
        "PYTHONUNBUFFERED": "1",
    }
    for inherited in ("REDIS_URL", "SIGIL_CODE_DIR", "SIGIL_OWNER_PASSWORD"):
        env.pop(inherited, None)
    yield env
    shutil.rmtree(var_dir, ignore_errors=True)


class Output:
    """Collects a process's output lines in a thread."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self.thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for raw in process.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def has(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def __str__(self) -> str:
        return "\n".join(self.lines)


@contextlib.contextmanager
def listening_socket():
    """A port on 127.0.0.1 that something listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def http_status(port: int, path: str) -> int | None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    except OSError:
        return None
    finally:
        connection.close()


def oversized_headers_answer(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /_health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 2_000_000 + b"\r\n\r\n")
        answer = sock.recv(4096)
    assert b"<html" not in answer.lower()
    return answer


def shell_umask() -> None:
    """As a shell with the usual umask starts it (this process runs with Sigil's own)."""
    os.umask(0o022)


def start_runsigil(env: dict[str, str], web_port: int, *, migrate: bool = True) -> tuple[subprocess.Popen, Output]:
    """`make run` on a fresh var directory, where an earlier run placed an agent (so its
    workerd, on the first port, is started at once); `migrate=False` starts it again."""
    var_dir = Path(env["SIGIL_VAR_DIR"])
    if migrate:
        subprocess.run(
            [sys.executable, MANAGE, "migrate", "--verbosity", "0"], env=env, check=True, preexec_fn=shell_umask
        )
        (var_dir / "workerd").mkdir()
        (var_dir / "workerd" / "ports.json").write_text(json.dumps({"alice": 0}))
    return launch_runsigil(env, web_port, preexec_fn=shell_umask)


def launch_runsigil(env: dict[str, str], web_port: int, **popen) -> tuple[subprocess.Popen, Output]:
    """`manage.py runsigil` on `web_port` in a session of its own, its output collected."""
    process = subprocess.Popen(
        [sys.executable, MANAGE, "runsigil", "--port", str(web_port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        **popen,
    )
    return process, Output(process)


def runsigil_refused(env: dict[str, str], port: int) -> subprocess.CompletedProcess:
    """`manage.py runsigil` on `port`, run to its end (a refusal ends it at once)."""
    return subprocess.run(
        [sys.executable, MANAGE, "runsigil", "--port", str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def stop_with_ctrl_c(process: subprocess.Popen, output: Output) -> None:
    """Ctrl-C, as an owner stops `make run`: the supervisor stops everything and exits 0."""
    process.send_signal(signal.SIGINT)
    assert process.wait(60) == 0, str(output)


def kill_if_running(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_runsigil_starts_everything_restarts_what_dies_and_ctrl_c_stops_it_all(embedded_env):
    web_port, workerd_port = free_port(), int(embedded_env["SIGIL_WORKERD_PORT"])
    var_dir = Path(embedded_env["SIGIL_VAR_DIR"])
    process, output = start_runsigil(embedded_env, web_port)
    children: set[int] = set()
    try:
        wait_until(lambda: output.has("Press Ctrl-C to stop.") or process.poll() is not None, timeout=60)
        assert output.has(f"Sigil is running at http://127.0.0.1:{web_port}/"), str(output)

        assert http_status(web_port, "/admin/login/") == 200
        assert port_is_open(workerd_port)
        assert redis.Redis(unix_socket_path=str(var_dir / "redis.sock")).ping()
        assert output.has(f"http://127.0.0.1:{web_port}/admin/")
        assert output.has("/_api/schema/docs")
        assert output.has("createagent NAME --json")
        assert output.has("SQLite")
        assert output.has("bundled redis-server")
        password = re.search(r"user owner, password (\S+), shown until you sign in", str(output)).group(1)

        # Its web server reads chunked bodies: a deploy and a call sent in chunks arrive whole.
        agent = subprocess.run(
            [sys.executable, MANAGE, "createagent", "chunky", "--json"],
            env=embedded_env,
            check=True,
            capture_output=True,
            text=True,
        )
        tokens = json.loads(agent.stdout)
        chunky = AgentClient("chunky", tokens["deploy_token"], tokens["invoke_token"], f"http://127.0.0.1:{web_port}")
        deploy_and_echo_chunked(chunky.base_url, chunky, chunky.session)

        # granian, as in production: the admin's files, and headers past its limit refused
        # with a bare 431 (no HTML page), the connection closed.
        assert http_status(web_port, "/static/admin/css/base.css") == 200
        assert oversized_headers_answer(web_port).startswith(b"HTTP/1.1 431 ")

        children |= descendants(process.pid)
        web = next(pid for pid in children if "granian" in command_line(pid) and "--interface" in command_line(pid))
        runworkerd = next(pid for pid in children if "runworkerd" in command_line(pid))
        workerd = next(pid for pid in descendants(runworkerd) if "workerd serve" in command_line(pid))
        # A runworkerd killed outright takes its workerd with it (the kernel's parent-death
        # signal, and the supervisor's stop of its process group).
        os.kill(web, signal.SIGKILL)
        os.kill(runworkerd, signal.SIGKILL)
        wait_until(lambda: not is_alive(workerd), timeout=5, what="the orphaned workerd to be stopped")
        wait_until(lambda: http_status(web_port, "/admin/login/") == 200, timeout=15, what="the web server again")
        wait_until(lambda: port_is_open(workerd_port), timeout=15, what="workerd again")
        children |= descendants(process.pid)

        stop_with_ctrl_c(process, output)
    finally:
        kill_if_running(process)
        # What the supervisor killed last may take a moment to die.
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not any(is_alive(pid) for pid in children), timeout=3)
        left_behind = [pid for pid in children if is_alive(pid)]
        for pid in left_behind:
            os.kill(pid, signal.SIGKILL)
    output.thread.join(5)

    assert output.has("Sigil stopped.")
    assert left_behind == []
    assert not port_is_open(web_port)
    assert not port_is_open(workerd_port)
    with sqlite3.connect(var_dir / "sigil.sqlite3") as db:
        (encoded,) = db.execute("select password from auth_user where username = 'owner' and is_superuser").fetchone()
    assert check_password(password, encoded)


@pytest.mark.slow
def test_with_a_json_log_every_line_of_every_process_is_one_json_record(embedded_env):
    web_port = free_port()
    # Beat's stats flush every second: routine lines that must not show at INFO.
    env = {**embedded_env, "SIGIL_LOG_FORMAT": "json", "SIGIL_STATS_FLUSH_INTERVAL_SECONDS": "1"}
    process, output = start_runsigil(env, web_port)
    try:
        wait_until(lambda: output.has("Press Ctrl-C to stop.") or process.poll() is not None, timeout=60)
        assert http_status(web_port, "/alice/nothing") == 401
        wait_until(lambda: output.has('"sigil.access"'), timeout=10, what="the access line")
        time.sleep(2)  # a few flushes
        stop_with_ctrl_c(process, output)
    finally:
        kill_if_running(process)
    output.thread.join(5)

    records = [json.loads(line) for line in output.lines]  # every line, or this fails
    for record in records:
        assert {"time", "level", "process", "logger", "message"} <= set(record), record
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"]), record
    by_process = {record["process"] for record in records}
    assert {"supervisor", "workerd", "celery", "web"} <= by_process
    access = next(r for r in records if r["logger"] == "sigil.access")
    assert (access["process"], access["path"], access["status"]) == ("web", "/alice/nothing", 401)
    assert re.fullmatch(r"[0-9a-f]{16}", access["request_id"])
    # Sigil's own lines, Celery's and granian's in the same format (not relayed as output).
    assert any(r["process"] == "celery" and r["logger"].startswith("celery.") for r in records)
    assert any(r["process"] == "web" and r["logger"].startswith("_granian") for r in records)
    assert any(r["process"] == "workerd" and r["logger"].startswith("capabilities.") for r in records)
    banner = next(r for r in records if "Sigil is running at" in r["message"])
    assert banner["process"] == "supervisor" and "/_api/schema/docs" in banner["message"]
    # Routine background work is at DEBUG, below the default INFO.
    assert not any("Sending due task" in r["message"] or "succeeded in" in r["message"] for r in records)


def test_runsigil_refuses_to_start_on_a_port_in_use(embedded_env):
    with listening_socket() as port:
        result = runsigil_refused(embedded_env, port)
    assert result.returncode == 1
    assert f"port {port} is in use" in result.stderr


def test_the_local_backend_runs_workerd_and_no_emulator(settings):
    settings.SIGIL_EMBEDDED_REDIS = False
    settings.SIGIL_BACKEND = "local"

    programs, _ = sigil_programs(port=8000, backends=["local"])

    assert [program.name for program in programs] == ["workerd", "web", "celery"]
    web = programs[1].argv
    assert "granian" in web[0] and "sigil_site.asgi:application" in web


def test_dev_serves_with_uvicorn_reloading_on_code_changes(settings):
    settings.SIGIL_EMBEDDED_REDIS = False

    programs, _ = sigil_programs(port=8000, backends=["local"], dev=True)

    web = next(program.argv for program in programs if program.name == "web")
    assert web[0].endswith("uvicorn") and "--reload" in web
    assert "sigil_site.asgi:development_application" in web


def test_the_emulator_runs_when_the_cloudflare_api_base_points_at_it(settings):
    settings.SIGIL_EMBEDDED_REDIS = False
    settings.SIGIL_BACKEND = "worker-pool"
    settings.CF_API_BASE = f"http://127.0.0.1:{settings.CF_EMULATOR_PORT}/client/v4"

    programs, _ = sigil_programs(port=8000, backends=["worker-pool"])

    assert [program.name for program in programs] == ["cfemulator", "web", "celery"]


def test_the_celery_worker_consumes_the_deploys_queue_beside_the_default_one(settings):
    from sigil_site.celery import app

    settings.SIGIL_EMBEDDED_REDIS = False
    settings.SIGIL_BACKEND = "worker-pool"

    programs, _ = sigil_programs(port=8000, backends=["worker-pool"])

    celery = next(program for program in programs if program.name == "celery")
    queues = celery.argv[celery.argv.index("--queues") + 1].split(",")
    # A deploy on a Cloudflare runtime is routed to its own queue: a worker that skipped it
    # would leave every such deploy at 202 for good.
    assert settings.SIGIL_DEPLOY_QUEUE in queues
    assert app.conf.task_default_queue in queues


@pytest.mark.slow
def test_on_an_emulated_cloudflare_runtime_the_workers_push_call_records_to_the_web_server(embedded_env):
    # Nothing says where the origin is: under the emulator it is the web server on loopback.
    web_port = free_port_block()
    env = {**embedded_env, "SIGIL_BACKEND": "loader"}
    process, output = start_runsigil(env, web_port)
    try:
        wait_until(lambda: output.has("Press Ctrl-C to stop.") or process.poll() is not None, timeout=90)
        assert output.has(f"Sigil is running at http://127.0.0.1:{web_port}/"), str(output)
        created = subprocess.run(
            [sys.executable, MANAGE, "createagent", "alice", "--json"], env=env, check=True, capture_output=True
        )
        tokens = json.loads(created.stdout)
        alice = AgentClient("alice", tokens["deploy_token"], tokens["invoke_token"], f"http://127.0.0.1:{web_port}")
        code = "export default { async fetch() { console.log('pushed from the loader'); return new Response('ok') } }"
        assert alice.deploy(name="logs", code=code).status_code in (201, 202)
        answered = wait_until(lambda: (a := alice.call("/alice/logs")).status_code == 200 and a, timeout=60)
        request_id = answered.headers["X-Request-Id"]

        def records():
            url = f"{alice.base_url}/_api/capabilities/alice--logs/logs"
            headers = alice.headers(alice.invoke_token)
            return alice.session.get(url, params={"request_id": request_id}, headers=headers).json().get("records")

        [record] = wait_until(records, timeout=30, what="the call's record pushed to the web server")
        assert [line["text"] for line in record["logs"]] == ["pushed from the loader"]
        stop_with_ctrl_c(process, output)
    finally:
        kill_if_running(process)


RUNTIMES_PROCESS = {"local": "workerd", "worker-pool": "cfemulator", "platform": "cfemulator", "loader": "cfemulator"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("previous", "current"),
    [(previous, current) for previous in RUNTIMES_PROCESS for current in RUNTIMES_PROCESS if previous != current],
)
def test_a_runtime_still_holding_capabilities_after_a_switch_runs_beside_the_new_one(settings, previous, current):
    from agents.models import Agent
    from capabilities.models import Capability

    settings.SIGIL_EMBEDDED_REDIS = False
    settings.SIGIL_BACKEND = current
    settings.CF_API_BASE = f"http://127.0.0.1:{settings.CF_EMULATOR_PORT}/client/v4"  # the emulator: make run's
    alice = Agent.objects.create(name="alice")
    held = Capability.objects.create(
        agent=alice, name="a", full_name="alice--a", type="normal", state="live", slot="s-1", backend=previous
    )
    # Rows that hold nothing on the previous runtime: paged out there (a call pages them in on
    # the current one), removed, and one already moved.
    for name, state, backend in (("b", "paged_out", previous), ("c", "removed", previous), ("d", "live", current)):
        Capability.objects.create(
            agent=alice, name=name, full_name=f"alice--{name}", type="normal", state=state, slot="s-2", backend=backend
        )

    assert runtimes_served() == [current, previous]
    programs, _ = sigil_programs(port=8000, backends=runtimes_served())
    names = [program.name for program in programs]
    expected = list(dict.fromkeys([RUNTIMES_PROCESS[current], RUNTIMES_PROCESS[previous]]))
    assert names == [*expected, "web", "celery"]
    # The runtimes' processes start together, and all answer before the web server starts.
    assert [program.needed_by_others for program in programs] == [*([False] * (len(expected) - 1)), True, True, False]

    # Waiting for its delete there still holds the previous runtime; once moved, nothing does.
    Capability.objects.filter(pk=held.pk).update(state="evicting")
    assert runtimes_served() == [current, previous]
    Capability.objects.filter(pk=held.pk).update(state="live", backend=current)
    assert runtimes_served() == [current]
    programs, _ = sigil_programs(port=8000, backends=runtimes_served())
    assert [program.name for program in programs] == [RUNTIMES_PROCESS[current], "web", "celery"]


class Calls:
    """A caller calling each capability in turn from a thread, filing every answer:
    (sent, status, Retry-After, body); status 0 is a refused or broken connection."""

    def __init__(self, base_url: str, token: str, names: list[str]) -> None:
        import requests

        self.session, self.base_url, self.token, self.names = requests.Session(), base_url, token, names
        self.answers: list[tuple[float, int, str | None, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import requests

        turn = 0
        while not self.stop.is_set():
            name = self.names[turn % len(self.names)]
            turn += 1
            sent = time.monotonic()
            try:
                response = self.session.get(
                    f"{self.base_url}/alice/{name}", headers={"Authorization": f"Bearer {self.token}"}, timeout=30
                )
                self.answers.append((sent, response.status_code, response.headers.get("Retry-After"), response.text))
            except requests.ConnectionError:
                self.answers.append((sent, 0, None, ""))
                self.session.close()
            time.sleep(0.02)

    def wait_for_answers(self, count: int, *, what: str) -> None:
        """Until `count` more calls are answered 200 from now."""
        since = time.monotonic()
        ok = lambda: sum(1 for sent, status, _, _ in self.answers if sent >= since and status == 200)  # noqa: E731
        wait_until(lambda: ok() >= count, timeout=30, what=what)


def wait_running(process: subprocess.Popen, output: Output) -> None:
    wait_until(lambda: output.has("Press Ctrl-C to stop.") or process.poll() is not None, timeout=90)
    assert process.poll() is None, str(output)


def switchbackend(env: dict[str, str]) -> subprocess.CompletedProcess:
    """`manage.py switchbackend` from a plain shell: one that did not set SIGIL_BACKEND."""
    plain = {name: value for name, value in env.items() if name != "SIGIL_BACKEND"}
    return subprocess.run(
        [sys.executable, MANAGE, "switchbackend"], env=plain, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_switching_runtimes_as_the_owner_does_answers_every_call_or_tells_it_to_come_back(embedded_env):
    """`make run`, Ctrl-C, `SIGIL_BACKEND=worker-pool make run`, switchbackend, and back to
    local, with calls throughout: each is answered by the runtime holding its capability, or,
    while Sigil restarts, refused or answered 503 with Retry-After; never a 502."""
    # Below the kernel's ephemeral ports, as the emulator's port derived from it must be:
    # the callers' own connections take those at any moment.
    web_port = free_port_block()
    env = {**embedded_env, "SIGIL_SWITCH_GRACE_SECONDS": "0.5", "SIGIL_DEPLOY_COOLDOWN_SECONDS": "0"}
    names = ["a", "b", "c"]
    process, output = start_runsigil(env, web_port)
    restarts: list[tuple[float, float]] = []  # (Ctrl-C, Sigil running again)
    calls = None
    try:
        wait_running(process, output)
        password = re.search(r"user owner, password (\S+), shown until you sign in", str(output)).group(1)
        agent = subprocess.run(
            [sys.executable, MANAGE, "createagent", "alice", "--json"], env=env, check=True, capture_output=True
        )
        tokens = json.loads(agent.stdout)
        alice = AgentClient("alice", tokens["deploy_token"], tokens["invoke_token"], f"http://127.0.0.1:{web_port}")
        for name in names:
            code = f"export default {{ async fetch() {{ return new Response('{name}') }} }}"
            assert alice.deploy(name=name, code=code).status_code == 201
        calls = Calls(alice.base_url, alice.invoke_token, names)
        calls.thread.start()

        for backend, previous in (("worker-pool", "local"), ("local", "worker-pool")):
            calls.wait_for_answers(len(names), what="calls before the restart")
            interrupted = time.monotonic()
            stop_with_ctrl_c(process, output)
            process, output = launch_runsigil({**env, "SIGIL_BACKEND": backend}, web_port)
            wait_running(process, output)
            restarts.append((interrupted, time.monotonic()))
            # Nobody signed in yet: the final banner still carries the owner's password.
            assert output.has(f"user owner, password {password}, shown until you sign in"), str(output)
            # The capabilities are still on the previous runtime, whose processes run too.
            assert output.has(f"also     {previous}"), str(output)
            # /_health names the exact command, which works from any shell.
            command = f"SIGIL_BACKEND={backend} python manage.py switchbackend"
            warnings = requests.get(f"{alice.base_url}/_health", timeout=10).json()["warnings"]
            assert any(f"`{command}` moves them to {backend}" in warning for warning in warnings), warnings
            calls.wait_for_answers(2 * len(names), what="calls before the switch")
            # From a plain shell it moves them to the runtime the running Sigil serves.
            moved = switchbackend(env)
            assert moved.returncode == 0, moved.stdout + moved.stderr
            assert f"Switched to {backend}: {len(names)} moved." in moved.stdout, moved.stdout
            calls.wait_for_answers(2 * len(names), what="calls after the switch")
        calls.stop.set()
        calls.thread.join(30)
        stop_with_ctrl_c(process, output)
    finally:
        if calls is not None:
            calls.stop.set()
        kill_if_running(process)
    # With no Sigil running, a plain shell cannot tell the runtime: refused, saying what to pass.
    refused = switchbackend(env)
    assert refused.returncode == 1 and "SIGIL_BACKEND=worker-pool python manage.py switchbackend" in refused.stderr

    def restarting(sent: float) -> bool:
        return any(interrupted <= sent <= running for interrupted, running in restarts)

    wrong = [(status, body[:100]) for sent, status, _, body in calls.answers if status != 200 and not restarting(sent)]
    assert wrong == []
    assert all(body in names for _, status, _, body in calls.answers if status == 200)
    in_restarts = {(status, retry_after) for sent, status, retry_after, _ in calls.answers if restarting(sent)}
    assert in_restarts <= {(200, None), (0, None), (503, "1")}, in_restarts
    assert (503, "1") in in_restarts  # told to come back rather than refused, for most of it
