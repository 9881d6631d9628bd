"""Invoke benchmark: what Sigil adds to a warm call, and how long the first call after a deploy takes.

    .venv/bin/python bench/invoke.py [--rounds 3] [--seconds 5] [--servers granian,uvicorn]

It starts everything it measures on 127.0.0.1, in a fresh temporary var directory: the
bundled Redis (or the one at REDIS_URL, which it writes to but never flushes), a migrated
SQLite database, workerd with the loader host, and Sigil under each ASGI server as it would
run (several worker processes, keep-alive). It creates an agent with
`manage.py createagent`, deploys a small capability over the REST API, then with wrk
measures, for workerd called directly (the loader host with Sigil's internal headers, the
same code) and for Sigil under each server:

- warm latency, p50 and p99 of every call, over one keep-alive connection;
- warm throughput over 16 concurrent connections, in one-second turns across the targets
  so that other work on the machine slows them alike, and the CPU time each part (server,
  workerd, Redis, wrk) spent per request (Linux: read from /proc);

then the time of the first call after a deploy of a fresh capability. It prints what Sigil
adds (p50 and p99 over bare workerd, throughput ratio, workerd's CPU per call behind Sigil
against alone) against the targets, and stops everything it started, by pid.

Needs wrk (Debian and Ubuntu: `apt-get install wrk`) and workerd (`npm ci`).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import (
    Processes,
    deploy,
    fresh_var_dir,
    load_average,
    manage,
    percentile,
    request,
    sigil_environment,
    wait_for_health,
)

from capabilities.runtimes.base import CodeBundle
from capabilities.workerd.group import read_status
from sigil.ports import free_port, free_port_block
from testsupport.servers import server_command

BENCH_DIR = Path(__file__).resolve().parent
# Latency runs time every call in Lua (wrk's own percentiles are corrected for coordinated
# omission, which over one connection turns one stall into many slow samples); throughput
# runs only need wrk's summary.
LATENCY_LUA = BENCH_DIR / "latency.lua"
THROUGHPUT_LUA = BENCH_DIR / "throughput.lua"
AGENT = "bench"
CAPABILITY = "hello"
REPLY = "hello from a capability"
CODE = "export default { async fetch() { return new Response(%s) } }"
THROUGHPUT_CONNECTIONS = 16
PACED_CONNECTIONS = (1, 2, 4)

# The targets for a warm call through Sigil, and for the first call after a deploy.
MAX_ADDED_P50_MS = 0.7
MAX_ADDED_P99_MS = 3.0
MIN_THROUGHPUT_RATIO = 0.35
MAX_WORKERD_CPU_RATIO = 1.3  # workerd's CPU per call behind Sigil, against called alone
MAX_COLD_P50_MS = 20.0


SERVER_LABELS = {"uvicorn": "uvicorn", "granian": "granian asgi"}


@dataclass(frozen=True)
class Load:
    """One wrk run, as latency.lua and throughput.lua print it, with the CPU each part used."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    failures: int
    cpu_us: dict[str, float]  # per request: server, workerd, redis, wrk

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


@dataclass(frozen=True)
class Target:
    label: str
    url: str
    headers: dict[str, str]
    # The processes that serve this target, by part; their CPU time is charged to it.
    processes: dict[str, int]


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(root: int) -> float:
    """User and system CPU time of a process and its descendants, from /proc (Linux)."""
    total = 0.0
    with contextlib.suppress(FileNotFoundError):
        fields = Path(f"/proc/{root}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        for task in Path(f"/proc/{root}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += cpu_seconds(int(child))
    return total


def wrk_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wrk(target: Target, *, connections: int, seconds: float, script: Path = THROUGHPUT_LUA) -> Load:
    command = [
        "wrk",
        "--threads",
        "1",
        "--connections",
        str(connections),
        "--duration",
        f"{seconds:g}s",
        "--timeout",
        "5s",
        "--script",
        str(script),
    ]
    for name, value in target.headers.items():
        command += ["--header", f"{name}: {value}"]
    cpu_before = {part: cpu_seconds(pid) for part, pid in target.processes.items()}
    cpu_before["wrk"] = wrk_cpu_seconds()
    output = subprocess.run([*command, target.url], capture_output=True, text=True, check=True).stdout
    cpu_used = {part: cpu_seconds(pid) - cpu_before[part] for part, pid in target.processes.items()}
    cpu_used["wrk"] = wrk_cpu_seconds() - cpu_before["wrk"]
    data = json.loads(next(line for line in output.splitlines() if line.startswith("{")))
    return Load(
        requests=data["requests"],
        seconds=data["duration_us"] / 1e6,
        p50_ms=data["p50_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        failures=data["socket_errors"] + data["bad_status"],
        cpu_us={part: used / max(data["requests"], 1) * 1e6 for part, used in cpu_used.items()},
    )


def interleaved_throughput(targets: dict[str, Target], *, seconds: float) -> dict[str, Load]:
    """Each target's throughput over `seconds` one-second runs, taken in turn with the
    other targets', so that other work on the machine slows every target alike."""
    slices: dict[str, list[Load]] = {name: [] for name in targets}
    for _ in range(max(1, round(seconds))):
        for name, target in targets.items():
            slices[name].append(wrk(target, connections=THROUGHPUT_CONNECTIONS, seconds=1))
    totals = {}
    for name, loads in slices.items():
        requests = sum(load.requests for load in loads)
        parts = {part for load in loads for part in load.cpu_us}
        totals[name] = Load(
            requests=requests,
            seconds=sum(load.seconds for load in loads),
            p50_ms=statistics.median(load.p50_ms for load in loads),
            p99_ms=statistics.median(load.p99_ms for load in loads),
            failures=sum(load.failures for load in loads),
            cpu_us={part: sum(load.cpu_us[part] * load.requests for load in loads) / requests for part in parts},
        )
    return totals


def check_reply(target: Target, port: int, path: str) -> None:
    """One call before the load, so a wrong setup fails loudly instead of benchmarking errors."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    response, data = request(connection, "GET", path, headers=target.headers)
    connection.close()
    if response.status != 200 or data.decode() != REPLY:
        raise RuntimeError(f"{target.label} answered {response.status}: {data[:300]!r}")


@dataclass(frozen=True)
class FirstCall:
    total_ms: float
    capability_ms: float  # workerd's part, from the Server-Timing header Sigil sends
    deploy_ms: float  # the deploy before it, which starts the code once (its start check)


def measure_cold(port: int, tokens: dict[str, str], *, server: str, runs: int) -> list[FirstCall]:
    """Deploy a fresh capability, then time its first call on the same keep-alive connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    invoke = {"Authorization": f"Bearer {tokens['invoke_token']}"}
    timings = []
    for run in range(runs):
        name = f"cold-{server}-{run}"
        # A new sha per run: workerd has never seen this code, so it loads a new isolate.
        deploying = time.perf_counter()
        deploy(connection, tokens["deploy_token"], name, CODE % json.dumps(f"{REPLY} ({name})"))
        deploy_ms = (time.perf_counter() - deploying) * 1000
        started = time.perf_counter()
        response, data = request(connection, "GET", f"/{AGENT}/{name}", headers=invoke)
        total_ms = (time.perf_counter() - started) * 1000
        if response.status != 200:
            raise RuntimeError(f"the first call of {name} answered {response.status}: {data[:300]!r}")
        timing = dict(part.strip().split(";dur=") for part in response.getheader("Server-Timing", "").split(","))
        timings.append(FirstCall(total_ms, float(timing.get("capability", "nan")), deploy_ms))
    connection.close()
    return timings


def spread(values: list[float], digits: int) -> str:
    """The median, and the range when there were several rounds."""
    middle = f"{statistics.median(values):.{digits}f}"
    if len(values) == 1:
        return middle
    return f"{middle} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="granian,uvicorn", help="comma-separated: granian, uvicorn")
    parser.add_argument("--workers", type=int, default=2, help="worker processes per server")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each wrk run")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the warm runs to see the spread")
    parser.add_argument("--cold-runs", type=int, default=20, help="fresh deploys timed per server")
    parser.add_argument("--json", type=Path, help="also write the raw figures to this file")
    args = parser.parse_args()
    servers = [s for s in args.servers.split(",") if s]

    if shutil.which("wrk") is None:
        print(
            "wrk is not installed: on Debian or Ubuntu `apt-get update && apt-get install -y wrk`, "
            "on macOS `brew install wrk`",
            file=sys.stderr,
        )
        return 2

    var_dir = fresh_var_dir("invoke")
    internal_secret = secrets.token_hex(32)
    env = sigil_environment(var_dir, SIGIL_INTERNAL_SECRET=internal_secret, SIGIL_WORKERD_PORT=str(free_port_block()))
    print(f"var dir {var_dir}; load average {load_average()}")

    with Processes() as processes:
        backing = {}  # the processes behind every target, by part, for the CPU figures
        redis_pid = processes.redis_unless_given(env, var_dir)
        if redis_pid is not None:
            backing["redis"] = redis_pid
        # The local runtime's workerd processes (one per agent) under their supervisor.
        processes.workerd(env, var_dir)

        manage("migrate", "--noinput", env=env)
        tokens = json.loads(manage("createagent", AGENT, "--json", env=env))

        ports, server_pids = {}, {}
        for server in servers:
            port = free_port()
            command = server_command(server, port=port, workers=args.workers)
            process = processes.start(command, env=env, log=var_dir / f"{server}.log")
            wait_for_health(port, process)
            ports[server], server_pids[server] = port, process.pid

        code = CODE % json.dumps(REPLY)
        first_port = ports[servers[0]]
        connection = http.client.HTTPConnection("127.0.0.1", first_port, timeout=30)
        deploy(connection, tokens["deploy_token"], CAPABILITY, code)
        connection.close()

        full = f"{AGENT}--{CAPABILITY}"
        # The agent's workerd, started by the first deploy.
        agent_workerd = read_status(var_dir / "workerd" / "supervisor.json")["processes"][AGENT]
        backing["workerd"] = agent_workerd["pid"]
        workerd_port = agent_workerd["port"]
        targets = {
            "workerd": Target(
                "workerd",
                f"http://127.0.0.1:{workerd_port}/",
                {"X-Sigil-Secret": internal_secret, "X-Sigil-Loader-Id": f"{full}@{CodeBundle.from_code(code).sha}"},
                {"workerd": backing["workerd"]},
            )
        }
        for server, port in ports.items():
            targets[server] = Target(
                SERVER_LABELS[server],
                f"http://127.0.0.1:{port}/{AGENT}/{CAPABILITY}",
                {"Authorization": f"Bearer {tokens['invoke_token']}"},
                {"server": server_pids[server], **backing},
            )
        check_reply(targets["workerd"], workerd_port, "/")
        for server, port in ports.items():
            check_reply(targets[server], port, f"/{AGENT}/{CAPABILITY}")

        latency: dict[str, list[Load]] = {name: [] for name in targets}
        throughput: dict[str, list[Load]] = {name: [] for name in targets}
        for round_number in range(args.rounds):
            for name, target in targets.items():
                print(f"round {round_number + 1}/{args.rounds}: latency, {target.label}", flush=True)
                # Warm every worker process, thread and upstream connection first.
                wrk(target, connections=THROUGHPUT_CONNECTIONS, seconds=1)
                latency[name].append(wrk(target, connections=1, seconds=args.seconds, script=LATENCY_LUA))
            print(f"round {round_number + 1}/{args.rounds}: throughput, all targets in turn", flush=True)
            for name, load in interleaved_throughput(targets, seconds=args.seconds).items():
                throughput[name].append(load)

        # workerd's CPU per call depends on its rate (fewer calls per wakeup cost more each):
        # bare workerd again over fewer connections, at rates like those it serves behind Sigil.
        paced = {n: wrk(targets["workerd"], connections=n, seconds=args.seconds) for n in PACED_CONNECTIONS}

        cold = {}
        for server, port in ports.items():
            print(f"cold: {args.cold_runs} deploys through {SERVER_LABELS[server]}", flush=True)
            cold[server] = measure_cold(port, tokens, server=server, runs=args.cold_runs)

    print(f"load average {load_average()} (other work on the machine shows up in the figures)")
    report(servers, targets, latency, throughput, cold, args)
    report_paced(servers, throughput, paced)
    if args.json:
        raw = {
            "latency": {name: [vars(load) for load in loads] for name, loads in latency.items()},
            "throughput": {
                name: [vars(load) | {"rps": load.rps} for load in loads] for name, loads in throughput.items()
            },
            "cold_ms": {server: [vars(call) for call in calls] for server, calls in cold.items()},
            "workers": args.workers,
        }
        args.json.write_text(json.dumps(raw, indent=2))
    shutil.rmtree(var_dir, ignore_errors=True)
    return 0


def report(servers, targets, latency, throughput, cold, args) -> None:
    rounds = range(args.rounds)
    bare_lat, bare_tput = latency["workerd"], throughput["workerd"]
    print()
    print(
        f"warm calls: p50/p99 over 1 connection, throughput over {THROUGHPUT_CONNECTIONS} connections, "
        f"{args.seconds:g} s each; {args.workers} worker processes; "
        + ("median (min-max) of " + str(args.rounds) + " rounds" if args.rounds > 1 else "one round")
    )
    header = f"{'':18} {'p50 ms':>18} {'p99 ms':>18} {'req/s':>22} {'+p50 ms':>18} {'+p99 ms':>18} {'ratio':>18}"
    print(header)
    for name, target in targets.items():
        lat, tput = latency[name], throughput[name]
        row = (
            f"{target.label:18} {spread([x.p50_ms for x in lat], 3):>18} {spread([x.p99_ms for x in lat], 3):>18} "
            f"{spread([x.rps for x in tput], 0):>22}"
        )
        if name != "workerd":
            added_p50 = [lat[i].p50_ms - bare_lat[i].p50_ms for i in rounds]
            added_p99 = [lat[i].p99_ms - bare_lat[i].p99_ms for i in rounds]
            ratio = [tput[i].rps / bare_tput[i].rps for i in rounds]
            row += f" {spread(added_p50, 3):>18} {spread(added_p99, 3):>18} {spread(ratio, 2):>18}"
        failures = sum(x.failures for x in lat + tput)
        if failures:
            row += f"  ({failures} failed requests)"
        print(row)
    print()
    parts = ["server", "workerd", "redis", "wrk"]
    print(
        f"CPU per request over {THROUGHPUT_CONNECTIONS} connections, µs (median);"
        f" the machine has {os.cpu_count()} cores:"
    )
    print(f"{'':18} " + " ".join(f"{part:>9}" for part in [*parts, "total"]))
    for name, target in targets.items():
        cells = []
        for part in parts:
            values = [load.cpu_us[part] for load in throughput[name] if part in load.cpu_us]
            cells.append(f"{statistics.median(values):9.0f}" if values else f"{'-':>9}")
        total = statistics.median(sum(load.cpu_us.values()) for load in throughput[name])
        print(f"{target.label:18} " + " ".join(cells) + f" {total:9.0f}")
    print()
    print(f"first call after a deploy of a fresh capability, {args.cold_runs} deploys per server:")
    for server in servers:
        timings = [call.total_ms for call in cold[server]]
        in_workerd = statistics.median(call.capability_ms for call in cold[server])
        deploys = statistics.median(call.deploy_ms for call in cold[server])
        print(
            f"{SERVER_LABELS[server]:18} p50 {statistics.median(timings):.2f} ms, "
            f"p90 {percentile(timings, 0.9):.2f} ms, max {max(timings):.2f} ms "
            f"(in workerd: p50 {in_workerd:.2f} ms; the deploy before it: p50 {deploys:.2f} ms)"
        )
    print()
    print(
        f"targets: +p50 <= {MAX_ADDED_P50_MS} ms, +p99 <= {MAX_ADDED_P99_MS} ms, "
        f"ratio >= {MIN_THROUGHPUT_RATIO}, workerd CPU behind Sigil <= {MAX_WORKERD_CPU_RATIO}x alone, "
        f"first call p50 < {MAX_COLD_P50_MS:g} ms"
    )
    bare_workerd_cpu = statistics.median(load.cpu_us["workerd"] for load in bare_tput)
    for server in servers:
        lat, tput = latency[server], throughput[server]
        checks = {
            "+p50": statistics.median(lat[i].p50_ms - bare_lat[i].p50_ms for i in rounds) <= MAX_ADDED_P50_MS,
            "+p99": statistics.median(lat[i].p99_ms - bare_lat[i].p99_ms for i in rounds) <= MAX_ADDED_P99_MS,
            "ratio": statistics.median(tput[i].rps / bare_tput[i].rps for i in rounds) >= MIN_THROUGHPUT_RATIO,
            "workerd cpu": statistics.median(load.cpu_us["workerd"] for load in tput)
            <= MAX_WORKERD_CPU_RATIO * bare_workerd_cpu,
            "cold": statistics.median(call.total_ms for call in cold[server]) < MAX_COLD_P50_MS,
        }
        verdict = ", ".join(f"{name} {'ok' if passed else 'MISSED'}" for name, passed in checks.items())
        print(f"{SERVER_LABELS[server]:18} {verdict}")


def report_paced(servers, throughput, paced) -> None:
    print()
    print("workerd alone over fewer connections (its CPU per call at a lower rate), against behind Sigil:")
    for connections, load in paced.items():
        print(
            f"  alone, {connections} connection(s): {load.rps:6.0f} req/s, "
            f"workerd {load.cpu_us['workerd']:4.0f} µs/call"
        )
    for server in servers:
        rps = statistics.median(load.rps for load in throughput[server])
        cpu = statistics.median(load.cpu_us["workerd"] for load in throughput[server])
        nearest = min(paced.values(), key=lambda load: abs(load.rps - rps))
        print(
            f"  behind {SERVER_LABELS[server]}: {rps:6.0f} req/s, workerd {cpu:4.0f} µs/call, "
            f"{cpu / nearest.cpu_us['workerd']:.2f}x alone at the nearest rate ({nearest.rps:.0f} req/s)"
        )


if __name__ == "__main__":
    sys.exit(main())
