"""What the benchmarks share: a fresh Sigil's environment under a temporary var directory,
its processes started and stopped by pid, Django set up in the benchmark's own process, the
Cloudflare emulator, and the few HTTP steps every benchmark takes (health, deploy)."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MANAGE = str(ROOT / "manage.py")


def options(doc: str, **defaults) -> argparse.Namespace:
    """The benchmark's command line, its description the docstring's first line: each
    `name=default` is an option `--name` (dashes for underscores) of the default's type, or
    `name=(default, help)`; a default of None takes a string."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, spec in defaults.items():
        default, help_text = spec if isinstance(spec, tuple) else (spec, None)
        kind = str if default is None else type(default)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=help_text)
    return parser.parse_args()


def fresh_var_dir(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"sigil-bench-{name}-"))


def sigil_environment(var_dir: Path, *, own_redis: bool = False, **settings: str) -> dict[str, str]:
    """The environment of a Sigil started by a benchmark: everything under `var_dir` (a fresh
    SQLite database; the Redis at REDIS_URL, or with `own_redis` a bundled one started by
    runsigil), quiet logs, no deploy cool-down; `settings` add to it or override it."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "sigil_site.settings",
        "DEBUG": "false",
        "SECRET_KEY": secrets.token_urlsafe(48),
        "SIGIL_VAR_DIR": str(var_dir),
        "SIGIL_INTERNAL_SECRET": secrets.token_hex(32),
        "SIGIL_OWNER_PASSWORD": secrets.token_urlsafe(16),
        "SIGIL_DEPLOY_COOLDOWN_SECONDS": "0",
        "SIGIL_LOG_LEVEL": "WARNING",
        "SIGIL_ACCESS_LOG": "false",
        "ALLOWED_HOSTS": "127.0.0.1",
    }
    for name in ("DATABASE_URL", "SIGIL_CODE_DIR", *(["REDIS_URL"] if own_redis else [])):
        env.pop(name, None)
    env.update(settings)
    return env


def local_sigil(name: str, **settings: str) -> tuple[Path, dict[str, str]]:
    """A fresh var directory and the environment of a Sigil on the local runtime with its
    own bundled Redis there (as `manage.py runsigil` starts it), said on the terminal."""
    from sigil.ports import free_port_block

    var_dir = fresh_var_dir(name)
    env = sigil_environment(
        var_dir, own_redis=True, SIGIL_BACKEND="local", SIGIL_WORKERD_PORT=str(free_port_block()), **settings
    )
    print(f"var dir {var_dir}; load average {load_average()}")
    return var_dir, env


def setup_django_here(var_dir: Path, **settings: str):
    """Django set up in this process on a fresh var directory with its own bundled Redis and a
    migrated database; the Redis server is returned for the caller to stop."""
    from sigil.embedded_redis import EmbeddedRedis

    embedded = EmbeddedRedis(var_dir / "redis")
    embedded.start()
    os.environ.update(sigil_environment(var_dir, REDIS_URL=embedded.url, **settings))
    os.environ.pop("DATABASE_URL", None)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return embedded


def start_emulator(var_dir: Path, *, port: int):
    """The Cloudflare emulator on 127.0.0.1:`port`, with its own workerd, started."""
    from django.conf import settings

    from testsupport.emulator import emulator_server

    emulator = emulator_server(workerd_binary=settings.SIGIL_WORKERD_BIN, state_dir=var_dir / "cfemulator", port=port)
    emulator.start()
    return emulator


def workerd_in_thread():
    """The local runtime's workerd processes, supervised in a thread of this process once it
    has reported; returns what stops them."""
    import threading

    from capabilities.log_sink import local_workerd_group
    from capabilities.workerd.group import read_status

    group = local_workerd_group()
    stopping = threading.Event()
    supervisor = threading.Thread(target=group.run, args=(stopping,), daemon=True)
    supervisor.start()
    wait_until(lambda: read_status(group.status_path) is not None, "the workerd supervisor did not report")

    def stop() -> None:
        stopping.set()
        supervisor.join(30)

    return stop


class Loops:
    """Threads that each run one of `loops` while `running` is set: started on entering,
    stopped and joined on leaving (a benchmark's callers)."""

    join_seconds = 30.0

    def set_loops(self, *loops) -> None:
        self.running = threading.Event()
        self.threads = [threading.Thread(target=loop, daemon=True) for loop in loops]

    def __enter__(self):
        self.running.set()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running.clear()
        for thread in self.threads:
            thread.join(self.join_seconds)


class Processes:
    """Child processes started by the benchmark, stopped by pid in reverse order."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def start(self, command: list[str], *, env: dict[str, str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.stack.callback(stop, process)
        return process

    def adopt(self, stopper) -> None:
        self.stack.callback(stopper)

    def redis_unless_given(self, env: dict[str, str], var_dir: Path) -> int | None:
        """Start the bundled Redis under `var_dir` unless `env` names one (REDIS_URL, which
        it then points at this one); the pid of what it started."""
        if env.get("REDIS_URL"):
            return None
        from sigil.embedded_redis import EmbeddedRedis

        server = EmbeddedRedis(var_dir / "redis")
        server.start()
        self.adopt(server.stop)
        env["REDIS_URL"] = server.url
        return server.process.pid

    def workerd(self, env: dict[str, str], var_dir: Path) -> subprocess.Popen:
        """The local runtime's workerd processes under `manage.py runworkerd`, once its
        supervisor has reported."""
        from capabilities.workerd.group import read_status

        process = self.start([sys.executable, MANAGE, "runworkerd"], env=env, log=var_dir / "runworkerd.log")
        status = var_dir / "workerd" / "supervisor.json"
        wait_until(lambda: read_status(status) is not None, f"runworkerd did not report; see {var_dir}/runworkerd.log")
        return process


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the process (a server's master stops its own workers), then SIGKILL its session."""
    from testsupport.processes import stop_session

    stop_session(process, timeout=10)


def manage(*args: str, env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, MANAGE, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def request(connection: http.client.HTTPConnection, method: str, path: str, *, headers=None, body=None):
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    return response, response.read()


# Health answered on this many fresh connections in a row: while runsigil's stand-in still
# shares the port with the web server (sigil_site/stand_in.py), some connections reach it,
# and one left in its queue when it closes is reset.
HEALTHY_IN_A_ROW = 10


def wait_for_health(port: int, process: subprocess.Popen | None = None, *, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    in_a_row = 0
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            response, _ = request(connection, "GET", "/_health")
            connection.close()
            in_a_row = in_a_row + 1 if response.status == 200 else 0
            if in_a_row == HEALTHY_IN_A_ROW:
                return
            if in_a_row:
                continue
        except OSError:
            in_a_row = 0
        time.sleep(0.1)
    raise RuntimeError(f"the server on port {port} was not healthy within {seconds:g} s")


def deploy(connection: http.client.HTTPConnection, token: str, name: str, code: str) -> None:
    body = json.dumps({"name": name, "code": code}).encode()
    headers = {**bearer(token), "Content-Type": "application/json"}
    response, data = request(connection, "POST", "/_api/deploy", headers=headers, body=body)
    if response.status not in (200, 201):
        raise RuntimeError(f"deploy of {name} answered {response.status}: {data.decode(errors='replace')}")


def wait_until(condition, what: str, *, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {seconds:g} s")
        time.sleep(0.05)


def serves(port: int, path: str, token: str) -> bool:
    """Whether Sigil on `port` is healthy and answers a call to `path` with 200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        health, body = request(connection, "GET", "/_health")
        if health.status != 200 or json.loads(body)["status"] != "ok":
            return False
        response, _ = request(connection, "GET", path, headers=bearer(token))
        return response.status == 200
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        connection.close()


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def client_cost(run, client, *, calls: int, rounds: int) -> tuple[float, float]:
    """The best of `rounds` runs of `run(client)`, a coroutine making `calls` calls, in this
    process: (its CPU µs per call, its calls per second)."""
    cpu, rate = [], []
    for _ in range(rounds):
        started, cpu_started = time.perf_counter(), time.process_time()
        run(client)
        cpu.append((time.process_time() - cpu_started) / calls * 1e6)
        rate.append(calls / (time.perf_counter() - started))
    return min(cpu), max(rate)
