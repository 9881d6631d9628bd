"""Call records benchmark: from a call's end to its record being readable, and what records
cost a warm call, on the local runtime.

    .venv/bin/python bench/call_logs.py [--calls 300] [--lines 5] [--warm 2000] [--rounds 2]

It runs all of Sigil as `make run` does (`manage.py runsigil`: the bundled Redis, workerd
with its log sink, a Celery worker, granian with the gateway) in a fresh temporary var
directory, on 127.0.0.1 only; creates an agent and deploys a capability that writes
`--lines` console lines per call. Then:

1. readable: one call at a time, it calls the capability through the gateway and polls
   `GET /_api/capabilities/{full}/logs?request_id=…` (every 2 ms, over its own keep-alive
   connection) until the call's record is there: p50, p99 and the worst of the time from
   the call's answer having been read to its record being readable (target: p99 under 1 s);
2. cost: `--warm` warm calls over one keep-alive connection (p50, p99) and over 8 (calls
   per second), with records on and then, in a second Sigil started with
   SIGIL_LOGS_ENABLED=false, off; `--rounds` times each, alternating, so that other work on
   the machine slows both alike.

It stops everything it started, by pid.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time

import harness

from sigil.ports import free_port

AGENT = "bench"
POLL_SECONDS = 0.002


def code(lines: int) -> str:
    return (
        "export default { async fetch(request) {\n"
        f"  for (let i = 0; i < {lines}; i++) console.log('line', i, {{ path: new URL(request.url).pathname }});\n"
        "  return new Response('logged');\n"
        "} }"
    )


def start_sigil(processes: harness.Processes, *, enabled: bool, lines: int) -> tuple[int, dict[str, str]]:
    """A Sigil of its own (its own var dir, Redis, workerd), with the capability deployed."""
    var_dir, env = harness.local_sigil(
        f"logs-{'on' if enabled else 'off'}", SIGIL_LOGS_ENABLED="true" if enabled else "false"
    )
    port = free_port()
    harness.manage("migrate", "--noinput", env=env)
    tokens = json.loads(harness.manage("createagent", AGENT, "--json", env=env))
    runsigil = processes.start(
        [sys.executable, "manage.py", "runsigil", "--port", str(port)], env=env, log=var_dir / "runsigil.log"
    )
    harness.wait_for_health(port, runsigil, seconds=120)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    harness.deploy(connection, tokens["deploy_token"], "chatty", code(lines))
    connection.close()
    return port, {"Authorization": f"Bearer {tokens['invoke_token']}"}


def warm_latency(port: int, invoke: dict[str, str], calls: int) -> list[float]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        response, _ = harness.request(connection, "GET", "/bench/chatty/call", headers=invoke)
        times.append((time.perf_counter() - started) * 1000)
        if response.status != 200:
            raise RuntimeError(f"a warm call answered {response.status}")
    connection.close()
    return times


def warm_throughput(port: int, invoke: dict[str, str], calls: int, connections: int = 8) -> float:
    def run() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(calls // connections):
            harness.request(connection, "GET", "/bench/chatty/call", headers=invoke)
        connection.close()

    threads = [threading.Thread(target=run) for _ in range(connections)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return (calls // connections * connections) / (time.perf_counter() - started)


def main() -> int:
    args = harness.options(
        __doc__,
        calls=300,
        lines=(5, "console lines each call writes"),
        warm=(2000, "warm calls per measurement of the cost"),
        rounds=2,
    )
    print(f"load average {harness.load_average()}")

    delays: list[float] = []
    with harness.Processes() as processes:
        port, invoke = start_sigil(processes, enabled=True, lines=args.lines)
        off_port, off_invoke = start_sigil(processes, enabled=False, lines=args.lines)
        calls = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        reads = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for i in range(args.calls + 5):
            response, _ = harness.request(calls, "GET", "/bench/chatty/call", headers=invoke)
            ended = time.perf_counter()
            if response.status != 200:
                raise RuntimeError(f"call {i} answered {response.status}")
            request_id = response.getheader("X-Request-Id")
            path = f"/_api/capabilities/bench--chatty/logs?request_id={request_id}"
            while True:
                answer, body = harness.request(reads, "GET", path, headers=invoke)
                if answer.status == 200 and json.loads(body)["records"]:
                    break
                if time.perf_counter() - ended > 10:
                    raise RuntimeError(f"the record of {request_id} was not readable within 10 s")
                time.sleep(POLL_SECONDS)
            if i >= 5:  # the first calls warm the isolate, the connections and the sink
                delays.append((time.perf_counter() - ended) * 1000)
        calls.close()
        reads.close()

        figures: dict[str, dict[str, list[float]]] = {"on": {}, "off": {}}
        warm_latency(off_port, off_invoke, 50)  # its isolate loaded, its connections open
        for _ in range(args.rounds):
            for label, target, headers in (("on", port, invoke), ("off", off_port, off_invoke)):
                latency = warm_latency(target, headers, args.warm)
                figures[label].setdefault("p50", []).append(harness.percentile(latency, 0.5))
                figures[label].setdefault("p99", []).append(harness.percentile(latency, 0.99))
                figures[label].setdefault("rps", []).append(warm_throughput(target, headers, args.warm))

    print(f"load average {harness.load_average()}")
    print(
        f"end of call to readable record, {len(delays)} calls of {args.lines} lines: "
        f"p50 {harness.percentile(delays, 0.5):.1f} ms, p99 {harness.percentile(delays, 0.99):.1f} ms, "
        f"worst {max(delays):.1f} ms "
        f"(target p99 under 1000 ms)"
    )
    for label in ("on", "off"):
        f = figures[label]
        print(
            f"warm calls, records {label}: p50 {min(f['p50']):.3f}–{max(f['p50']):.3f} ms, "
            f"p99 {min(f['p99']):.3f}–{max(f['p99']):.3f} ms, {min(f['rps']):.0f}–{max(f['rps']):.0f} calls/s "
            f"over 8 connections ({args.rounds} rounds of {args.warm} calls)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
