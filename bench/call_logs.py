"""Call records benchmark: from a call's end to its record being readable, and what records
cost a warm call, on the local runtime.

    .venv/bin/python bench/call_logs.py [--calls 300] [--lines 5] [--warm 2000] [--rounds 2]

It runs all of Sigil as `make run` does (`manage.py runsigil`: the bundled Redis, workerd
with its log sink, a Celery worker, granian with the engine) in a fresh temporary var
directory, on 127.0.0.1 only; creates an agent and deploys a capability that writes
`--lines` console lines per call. Then:

1. readable: one call at a time, it calls the capability through the engine and polls
   `GET /_api/capabilities/{full}/logs?request_id=…` (every 2 ms, over its own keep-alive
   connection) until the call's record is there: p50, p99 and the worst of the time from
   the call's answer having been read to its record being readable (target: p99 under 1 s);
2. cost: `--warm` warm calls over one keep-alive connection (p50, p99) and over 8 (calls
   per second), with records on and then, in a second Sigil started with
   SIGIL_LOGS_ENABLED=false, off; `--rounds` times each, alternating, so that other work on
   the machine slows both alike.

With `--emulator 1` it measures instead, on the worker-pool, platform and loader runtimes
against the Cloudflare emulator (which runs Tail Workers as Cloudflare does, and lets its
Workers reach the origin on loopback), where the tails push records to Sigil's origin
(SIGIL_ORIGIN_URL, the server here):

1. readable: as above, the time from a call's answer to its record being readable;
2. steady: `--rate` calls a second for `--seconds` seconds, one at a time: how many pushes
   reached the origin (its `sigil_call_record_pushes_total`), and how many Cloudflare API
   requests were made meanwhile (the emulator's request log, and Sigil's own count of its
   API calls): records should cost none.

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

from sigil import redis_keys
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


def steady_calls(port: int, invoke: dict[str, str], path: str, full: str, *, rate: float, seconds: float) -> int:
    """`rate` calls a second for `seconds`, one at a time; returns once every call's record is
    readable. The number of calls made."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    started = time.monotonic()
    calls = 0
    while (due := started + calls / rate) < started + seconds:
        time.sleep(max(0.0, due - time.monotonic()))
        response, _ = harness.request(connection, "GET", path, headers=invoke)
        if response.status != 200:
            raise RuntimeError(f"a steady call answered {response.status}")
        calls += 1
    last = response.getheader("X-Request-Id")
    deadline = time.monotonic() + 60
    while not json.loads(
        harness.request(connection, "GET", f"/_api/capabilities/{full}/logs?request_id={last}", headers=invoke)[1]
    )["records"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the steady calls' last record was not readable within 60 s")
        time.sleep(0.05)
    connection.close()
    return calls


def on_the_emulator(args: argparse.Namespace) -> int:
    """End of call to readable record, and what a steady rate of calls costs in pushes and API
    requests, on the Cloudflare runtimes, emulated."""
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
    from django.conf import settings
    from runtimes import place_queued

    from agents import services as agent_services
    from capabilities.books import call_logs
    from sigil.redis_client import get_redis
    from testsupport.servers import server_command

    emulator = harness.start_emulator(var_dir, port=emulator_port)
    servers: list[subprocess.Popen] = []
    results = {}
    try:
        agent = agent_services.agent_create(name=AGENT, actor="owner:bench")
        _, deploy = agent_services.token_issue(agent=agent, scope="deploy", actor="owner:bench")
        _, invoke = agent_services.token_issue(agent=agent, scope="invoke", actor="owner:bench")
        for backend in ("worker-pool", "platform", "loader"):
            port = free_port()
            # The origin: the server here, where this backend's Workers push records (this
            # process places the deploy, and so deploys the Workers, with it too).
            settings.SIGIL_ORIGIN_URL = origin = f"http://127.0.0.1:{port}"
            servers.append(
                subprocess.Popen(
                    server_command("uvicorn", port=port, workers=1),
                    cwd=harness.ROOT,
                    env={**os.environ, "SIGIL_BACKEND": backend, "SIGIL_ORIGIN_URL": origin},
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
            path, full = f"/{AGENT}/{name}/call", f"{AGENT}--{name}"
            delays = readable_after(port, harness.bearer(invoke), path, full, args.calls)
            pushes, api_logged = call_logs.call_records_pushes()[0], len(emulator.api.request_log())
            api_counted = int(get_redis().get(redis_keys.CF_CALLS) or 0)
            calls = steady_calls(port, harness.bearer(invoke), path, full, rate=args.rate, seconds=args.seconds)
            results[backend] = {
                "delays": delays,
                "calls": calls,
                "pushes": call_logs.call_records_pushes()[0] - pushes,
                "api_logged": len(emulator.api.request_log()) - api_logged,
                "api_counted": int(get_redis().get(redis_keys.CF_CALLS) or 0) - api_counted,
            }
    finally:
        for process in servers:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=10)
        emulator.stop()
        embedded.stop()
    print(f"load average {harness.load_average()}")
    for backend, figures in results.items():
        delays = figures["delays"]
        print(
            f"{backend} on the emulator, end of call to readable record, {len(delays)} calls of {args.lines} "
            f"lines: p50 {harness.percentile(delays, 0.5):.1f} ms, p99 {harness.percentile(delays, 0.99):.1f} ms, "
            f"worst {max(delays):.1f} ms"
        )
        print(
            f"{backend}: {figures['calls']} calls at {args.rate:g}/s over {args.seconds:g} s reached the origin in "
            f"{figures['pushes']} pushes ({figures['pushes'] / args.seconds:.2f} a second); Cloudflare API requests "
            f"meanwhile: {figures['api_logged']} in the emulator's log, {figures['api_counted']} counted by Sigil"
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
        rate=(10.0, "calls a second of the steady run, with --emulator 1"),
        seconds=(20.0, "how long the steady run lasts, with --emulator 1"),
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
