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

With `--emulator 1` it measures instead, on the worker-pool and platform runtimes against the
Cloudflare emulator (which runs Tail Workers as Cloudflare does), the time from a call's
answer to its record being readable: the capability's Tail Worker leaves it in Workers KV,
and a collector here does what the beat's task does every SIGIL_LOGS_COLLECT_INTERVAL_SECONDS
(`--collect-every`), so that interval bounds the figure.

It stops everything it started, by pid.
"""

from __future__ import annotations

import argparse
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


def readable_after(
    port: int, invoke: dict[str, str], path: str, full: str, calls: int, *, patience: float = 30
) -> list[float]:
    """ms from each call's answer to its record being readable, after 5 calls that warm the
    isolate, the connections and the sink; a record not readable within `patience` s fails."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    reads = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    delays = []
    for i in range(calls + 5):
        response, _ = harness.request(connection, "GET", path, headers=invoke)
        ended = time.perf_counter()
        if response.status != 200:
            raise RuntimeError(f"call {i} answered {response.status}")
        request_id = response.getheader("X-Request-Id")
        while True:
            answer, body = harness.request(
                reads, "GET", f"/_api/capabilities/{full}/logs?request_id={request_id}", headers=invoke
            )
            if answer.status == 200 and json.loads(body)["records"]:
                break
            if time.perf_counter() - ended > patience:
                raise RuntimeError(f"the record of {request_id} was not readable within {patience:g} s")
            time.sleep(POLL_SECONDS)
        if i >= 5:
            delays.append((time.perf_counter() - ended) * 1000)
    connection.close()
    reads.close()
    return delays


def on_the_emulator(args: argparse.Namespace) -> int:
    """End of call to readable record on the worker-pool and platform runtimes, emulated."""
    import os
    import signal
    import subprocess

    from cfemulator.api import DEV_ACCOUNT_ID, DEV_TOKEN
    from sigil.ports import free_port_block, port_is_open

    var_dir = harness.fresh_var_dir("logs-emulator")
    emulator_port = free_port()
    embedded = harness.setup_django_here(
        var_dir,
        SIGIL_WORKERD_PORT=str(free_port_block()),
        CF_API_BASE=f"http://127.0.0.1:{emulator_port}/client/v4",
        CF_API_TOKEN=DEV_TOKEN,
        CF_ACCOUNT_ID=DEV_ACCOUNT_ID,
        SIGIL_CF_WORKERS_BASE=f"http://127.0.0.1:{emulator_port}",
        SIGIL_DEPLOY_WAIT_SECONDS="0",  # placed here (place_queued), with no Celery worker
    )
    from runtimes import place_queued

    from agents import services as agent_services
    from capabilities import services
    from capabilities.runtimes import build_runtime
    from testsupport.servers import server_command

    emulator = harness.start_emulator(var_dir, port=emulator_port)
    servers: list[subprocess.Popen] = []
    done = threading.Event()
    results = {}
    try:
        agent = agent_services.agent_create(name=AGENT, actor="owner:bench")
        _, deploy = agent_services.token_issue(agent=agent, scope="deploy", actor="owner:bench")
        _, invoke = agent_services.token_issue(agent=agent, scope="invoke", actor="owner:bench")
        for backend in ("worker-pool", "platform"):
            port = free_port()
            servers.append(
                subprocess.Popen(
                    server_command("uvicorn", port=port, workers=1),
                    cwd=harness.ROOT,
                    env={**os.environ, "SIGIL_BACKEND": backend},
                    start_new_session=True,
                )
            )
            harness.wait_until(lambda port=port: port_is_open(port), "the Sigil server did not listen")
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            name = f"chatty-{backend}"
            answer, body = harness.request(
                connection,
                "POST",
                "/_api/deploy",
                headers={**harness.bearer(deploy), "Content-Type": "application/json"},
                body=json.dumps({"name": name, "code": code(args.lines)}),
            )
            if answer.status == 202:
                place_queued(backend, full=f"{AGENT}--{name}")
            elif answer.status != 201:
                raise RuntimeError(f"deploy on {backend}: {answer.status} {body[:300]!r}")
            connection.close()
            runtime = build_runtime(backend)
            done.clear()

            def collect(runtime=runtime) -> None:  # the beat's task
                while not done.wait(args.collect_every):
                    try:
                        services.call_records_collect(runtime=runtime)
                    except Exception as exc:  # the next round tries again, as the beat does
                        print(f"collecting failed: {exc!r}", file=sys.stderr)

            collector = threading.Thread(target=collect, daemon=True)
            collector.start()
            results[backend] = readable_after(
                port, harness.bearer(invoke), f"/{AGENT}/{name}/call", f"{AGENT}--{name}", args.calls
            )
            done.set()
            collector.join()
    finally:
        done.set()
        for process in servers:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=10)
        emulator.stop()
        embedded.stop()
    print(f"load average {harness.load_average()}")
    for backend, delays in results.items():
        print(
            f"{backend} on the emulator, end of call to readable record, {len(delays)} calls of {args.lines} "
            f"lines, collected every {args.collect_every:g} s: p50 {harness.percentile(delays, 0.5):.1f} ms, "
            f"p99 {harness.percentile(delays, 0.99):.1f} ms, worst {max(delays):.1f} ms"
        )
    return 0


def main() -> int:
    args = harness.options(
        __doc__,
        calls=300,
        lines=(5, "console lines each call writes"),
        warm=(2000, "warm calls per measurement of the cost"),
        rounds=2,
        emulator=(0, "1: measure on the emulator's Cloudflare runtimes instead"),
        collect_every=(2.0, "seconds between collections, with --emulator 1"),
    )
    print(f"load average {harness.load_average()}")
    if args.emulator:
        return on_the_emulator(args)

    with harness.Processes() as processes:
        port, invoke = start_sigil(processes, enabled=True, lines=args.lines)
        off_port, off_invoke = start_sigil(processes, enabled=False, lines=args.lines)
        delays = readable_after(port, invoke, "/bench/chatty/call", f"{AGENT}--chatty", args.calls, patience=10)

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
