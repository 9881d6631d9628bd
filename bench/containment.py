"""What a runaway capability costs everyone else on the local runtime, and for how long.

    .venv/bin/python bench/containment.py [--incidents 3] [--callers 4] [--normal-seconds 5]

Sigil as `make run` runs it, minus the browser: a SQLite database and a bundled Redis under a
temporary var directory, `manage.py runworkerd` (one workerd per agent under the watchdog,
SIGIL_CPU_MS=1000 as by default) and granian (two ASGI workers). Agent `runaway` owns a
capability that never leaves `while (true) {}`; three other agents own a capability that
answers `pong`. `--callers` threads call the other agents' capabilities round-robin over
keep-alive connections, without pause, the whole time.

- `normal`: their latency for `--normal-seconds` before any incident;
- `incident`: their latency from the moment the runaway call is sent until the runtime is
  healthy again, over `--incidents` incidents;
- `runaway answered`: from sending the runaway call to its `504 timeout`;
- `healthy again`: from sending the runaway call until `/_health` is `ok` and the runaway's
  agent is served by a fresh workerd (its other capability answers 200).

Every figure is in ms; the incidents' durations are medians (and the slowest).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capabilities.workerd.group import read_status  # noqa: E402
from sigil.embedded_redis import EmbeddedRedis  # noqa: E402
from sigil.ports import free_port, free_port_block, port_is_open  # noqa: E402
from testsupport.servers import server_command  # noqa: E402

SPIN = "export default { async fetch() { while (true) {} } }"
PONG = "export default { async fetch() { return new Response('pong') } }"
OTHERS = ("amber", "basil", "cedar")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--incidents", type=int, default=3)
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--normal-seconds", type=float, default=5.0)
    args = parser.parse_args()

    var_dir = Path(tempfile.mkdtemp(prefix="sigil-bench-containment-"))
    redis_server = EmbeddedRedis(var_dir / "redis")
    redis_server.start()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "sigil_site.settings",
        "SECRET_KEY": "bench",
        "SIGIL_VAR_DIR": str(var_dir),
        "REDIS_URL": redis_server.url,
        "SIGIL_WORKERD_PORT": str(free_port_block()),
        "SIGIL_DEPLOY_COOLDOWN_SECONDS": "0",
        "SIGIL_LOG_LEVEL": "WARNING",
        "SIGIL_ACCESS_LOG": "false",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("DATABASE_URL", None)
    children: list[subprocess.Popen] = []
    try:
        manage("migrate", "--noinput", env=env)
        tokens = {name: json.loads(manage("createagent", name, "--json", env=env)) for name in ("runaway", *OTHERS)}
        children.append(start([sys.executable, "manage.py", "runworkerd"], env, var_dir / "runworkerd.log"))
        status_path = var_dir / "workerd" / "supervisor.json"
        wait(lambda: read_status(status_path) is not None, "runworkerd to report")
        port = free_port()
        server = server_command("granian", port=port, workers=2)
        children.append(start(server, env, var_dir / "granian.log"))
        wait(lambda: port_is_open(port), "granian to listen")

        client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        deploy(client, tokens["runaway"], "spin", SPIN)
        deploy(client, tokens["runaway"], "pong", PONG)
        for name in OTHERS:
            deploy(client, tokens[name], "pong", PONG)
        targets = [(f"/{name}/pong", tokens[name]["invoke_token"]) for name in OTHERS]
        runaway_token = tokens["runaway"]["invoke_token"]

        load = Load(port, targets, callers=args.callers)
        load.start()
        time.sleep(1.0)  # warm every isolate and connection
        load.mark("warm-up")
        time.sleep(args.normal_seconds)
        load.mark("normal")

        answered, healthy = [], []
        for _ in range(args.incidents):
            client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # the server closed the idle one
            started = time.monotonic()
            response, _ = request(client, "GET", "/runaway/spin", token=runaway_token)
            client.close()
            if response.status != 504:
                raise RuntimeError(f"the runaway call answered {response.status}, expected 504")
            answered.append(time.monotonic() - started)
            wait(lambda: runtime_healthy(port, runaway_token), "the runtime to be healthy again", seconds=30)
            healthy.append(time.monotonic() - started)
            load.mark("incident")
            time.sleep(1.0)  # calm before the next one
            load.mark("between")
        load.stop()
    finally:
        for child in reversed(children):
            stop(child)
        redis_server.stop()
        shutil.rmtree(var_dir, ignore_errors=True)

    normal, incident = load.latencies("normal"), load.latencies("incident")
    failed = load.failures("normal") + load.failures("incident")
    print(f"other agents' calls ({args.callers} callers, {len(OTHERS)} agents), latency in ms")
    print(f"{'':<10} {'calls':>7} {'p50':>8} {'p99':>8} {'max':>8}")
    for label, values in (("normal", normal), ("incident", incident)):
        p50, p99 = percentile(values, 50), percentile(values, 99)
        print(f"{label:<10} {len(values):>7} {p50:>8.2f} {p99:>8.2f} {max(values):>8.2f}")
    print(f"failed calls of the other agents: {failed}")
    print()
    print(f"runaway call (SIGIL_CPU_MS=1000), {args.incidents} incidents, ms: median (slowest)")
    print(f"  runaway answered 504  {statistics.median(answered) * 1000:>7.0f} ({max(answered) * 1000:.0f})")
    print(f"  healthy again         {statistics.median(healthy) * 1000:>7.0f} ({max(healthy) * 1000:.0f})")
    return 0


class Load:
    """Threads calling the targets round-robin without pause; each answer is filed under
    the phase that was current when its call was sent."""

    def __init__(self, port: int, targets: list[tuple[str, str]], *, callers: int) -> None:
        self.port = port
        self.targets = targets
        self.phase = "warm-up"
        self.samples: list[tuple[str, float, int]] = []  # (phase, ms, status)
        self.running = threading.Event()
        self.threads = [threading.Thread(target=self.call, args=(i,), daemon=True) for i in range(callers)]
        self.phases: list[tuple[float, str]] = []

    def start(self) -> None:
        self.running.set()
        for thread in self.threads:
            thread.start()

    def mark(self, ended: str) -> None:
        """The phase `ended` is over; the next starts now."""
        following = {"warm-up": "normal", "normal": "incident", "incident": "between", "between": "incident"}
        self.phase = following[ended]

    def stop(self) -> None:
        self.running.clear()
        for thread in self.threads:
            thread.join(30)

    def call(self, index: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        turn = index
        while self.running.is_set():
            path, token = self.targets[turn % len(self.targets)]
            turn += 1
            phase = self.phase
            started = time.perf_counter()
            try:
                response, _ = request(connection, "GET", path, token=token)
                status = response.status
            except (OSError, http.client.HTTPException):
                connection.close()
                status = 0
            self.samples.append((phase, (time.perf_counter() - started) * 1000, status))

    def latencies(self, phase: str) -> list[float]:
        return [ms for p, ms, status in self.samples if p == phase and status == 200]

    def failures(self, phase: str) -> int:
        return sum(1 for p, _, status in self.samples if p == phase and status != 200)


def runtime_healthy(port: int, runaway_token: str) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        health, body = request(connection, "GET", "/_health")
        if health.status != 200 or json.loads(body)["status"] != "ok":
            return False
        response, _ = request(connection, "GET", "/runaway/pong", token=runaway_token)
        return response.status == 200
    except OSError:
        return False
    finally:
        connection.close()


def percentile(values: list[float], pct: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def request(connection, method: str, path: str, *, token: str | None = None, body: bytes | None = None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    return response, response.read()


def deploy(connection, tokens: dict, name: str, code: str) -> None:
    body = json.dumps({"name": name, "code": code}).encode()
    response, data = request(connection, "POST", "/_api/deploy", token=tokens["deploy_token"], body=body)
    if response.status != 201:
        raise RuntimeError(f"deploy of {name}: {response.status} {data[:300]!r}")


def manage(*args: str, env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL to the process's group (runworkerd keeps workerd in its own)."""
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def wait(condition, what: str, *, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
