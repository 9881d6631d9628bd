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

import functools
import http.client
import json
import shutil
import statistics
import sys
import threading
import time

from harness import (
    Processes,
    bearer,
    deploy,
    fresh_var_dir,
    manage,
    options,
    percentile,
    request,
    serves,
    sigil_environment,
    wait_until,
)

from sigil.ports import free_port, free_port_block, port_is_open
from testsupport.servers import server_command

SPIN = "export default { async fetch() { while (true) {} } }"
PONG = "export default { async fetch() { return new Response('pong') } }"
OTHERS = ("amber", "basil", "cedar")


def main() -> int:
    args = options(__doc__, incidents=3, callers=4, normal_seconds=5.0)

    var_dir = fresh_var_dir("containment")
    env = sigil_environment(var_dir, own_redis=True, SIGIL_WORKERD_PORT=str(free_port_block()), PYTHONUNBUFFERED="1")
    with Processes() as processes:
        processes.redis_unless_given(env, var_dir)
        manage("migrate", "--noinput", env=env)
        tokens = {name: json.loads(manage("createagent", name, "--json", env=env)) for name in ("runaway", *OTHERS)}
        processes.workerd(env, var_dir)
        port = free_port()
        processes.start(server_command("granian", port=port, workers=2), env=env, log=var_dir / "granian.log")
        wait_until(lambda: port_is_open(port), "granian did not listen")

        client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        deploy(client, tokens["runaway"]["deploy_token"], "spin", SPIN)
        deploy(client, tokens["runaway"]["deploy_token"], "pong", PONG)
        for name in OTHERS:
            deploy(client, tokens[name]["deploy_token"], "pong", PONG)
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
            response, _ = request(client, "GET", "/runaway/spin", headers=bearer(runaway_token))
            client.close()
            if response.status != 504:
                raise RuntimeError(f"the runaway call answered {response.status}, expected 504")
            answered.append(time.monotonic() - started)
            back = functools.partial(serves, port, "/runaway/pong", runaway_token)
            wait_until(back, "the runtime was not healthy again", seconds=30)
            healthy.append(time.monotonic() - started)
            load.mark("incident")
            time.sleep(1.0)  # calm before the next one
            load.mark("between")
        load.stop()
    shutil.rmtree(var_dir, ignore_errors=True)

    normal, incident = load.latencies("normal"), load.latencies("incident")
    failed = load.failures("normal") + load.failures("incident")
    print(f"other agents' calls ({args.callers} callers, {len(OTHERS)} agents), latency in ms")
    print(f"{'':<10} {'calls':>7} {'p50':>8} {'p99':>8} {'max':>8}")
    for label, values in (("normal", normal), ("incident", incident)):
        p50, p99 = percentile(values, 0.50), percentile(values, 0.99)
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
                response, _ = request(connection, "GET", path, headers=bearer(token))
                status = response.status
            except (OSError, http.client.HTTPException):
                connection.close()
                status = 0
            self.samples.append((phase, (time.perf_counter() - started) * 1000, status))

    def latencies(self, phase: str) -> list[float]:
        return [ms for p, ms, status in self.samples if p == phase and status == 200]

    def failures(self, phase: str) -> int:
        return sum(1 for p, _, status in self.samples if p == phase and status != 200)


if __name__ == "__main__":
    sys.exit(main())
