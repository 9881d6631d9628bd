"""Invoke benchmark: what Sigil adds to a warm call, over two floors, and how long the first call after a deploy takes.

    .venv/bin/python bench/invoke.py [--rounds 3] [--seconds 5] [--servers granian,uvicorn] [--records on|off]

It starts everything it measures on 127.0.0.1, in a fresh temporary var directory: the
bundled Redis (or the one at REDIS_URL, which it writes to but never flushes), a migrated
SQLite database, workerd with the loader host, and Sigil under each ASGI server as it would
run (several worker processes, keep-alive), with call records on (Sigil's default) unless
`--records off` (or SIGIL_LOGS_ENABLED=false) turns them off. It creates an agent with
`manage.py createagent`, deploys a small capability over the REST API, and starts the same
code bundle on plain workerd: the binary Sigil runs, serving the capability as a Worker
service of its own (no loader host, no tail, so the same with records on or off). Then with
wrk it measures two floors and Sigil under each server: plain workerd, the capability called
directly; the loader host, called directly with Sigil's internal headers (the workerd process
Sigil calls, running the capability through its Worker Loader, with the capability's tail when
records are on), the floor Sigil's targets are set against; and for each of them

- warm latency, p50 and p99 of every call, over one keep-alive connection;
- warm throughput over 16 concurrent connections, in one-second turns across the targets
  so that other work on the machine slows them alike, and the CPU time each part (server,
  workerd, Redis, wrk) spent per request (Linux: read from /proc);

then the time of the first call after a deploy of a fresh capability. It prints what each
adds over a floor (p50 and p99 added, throughput ratio): Sigil over plain workerd, Sigil
over the loader host, and the loader host over plain workerd; then the targets, which are
over the loader host (and workerd's CPU per call behind Sigil against the loader host
alone); and stops everything it started, by pid. Records on and off take a run each:
alternate them to compare.

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
    wait_until,
)

from capabilities.runtimes.base import CodeBundle
from capabilities.workerd.config import V8_FLAGS, capnp_string
from capabilities.workerd.group import read_status
from sigil.ports import free_port, free_port_block, port_is_open
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
# The two floors a warm call through Sigil is measured over, by their names in --json.
FLOORS = {"plain": "plain workerd", "loader": "loader host"}
OVER_FLOORS = {"plain": "plain workerd", "loader": "the loader host"}


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


def plain_workerd_config(bundle: CodeBundle, *, port: int) -> str:
    """The config of a workerd serving `bundle`'s modules as one Worker of its own on
    127.0.0.1:`port`, as anyone would run the code on workerd: no loader host, no tail. The
    modules are embedded from beside the config; the V8 flags are the loader host's
    (config.V8_FLAGS), so that the two floors differ by the host alone."""
    if bundle.bindings:
        raise ValueError("the plain floor runs code without bindings")
    modules = [bundle.main_module, *(name for name in bundle.modules if name != bundle.main_module)]
    return f"""using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  v8Flags = [{", ".join(capnp_string(flag) for flag in V8_FLAGS)}],
  services = [(name = "capability", worker = .capability)],
  sockets = [(name = "http", address = "127.0.0.1:{port}", http = (), service = "capability")],
);

const capability :Workerd.Worker = (
  modules = [{", ".join(f"(name = {capnp_string(name)}, esModule = embed {capnp_string(name)})" for name in modules)}],
  compatibilityDate = {capnp_string(bundle.compatibility_date)},
);
"""


def start_plain_workerd(
    processes: Processes, bundle: CodeBundle, *, binary: str, directory: Path, env: dict[str, str]
) -> tuple[int, int]:
    """`bundle` on plain workerd (`binary`) on a free loopback port, once it listens: (port, pid)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, source in bundle.modules.items():
        (directory / name).write_text(source)
    port = free_port()
    config = directory / "plain.capnp"
    config.write_text(plain_workerd_config(bundle, port=port))
    log = directory / "workerd.log"
    process = processes.start([binary, "serve", str(config)], env=env, log=log)
    wait_until(lambda: process.poll() is not None or port_is_open(port), f"plain workerd did not listen; see {log}")
    if process.poll() is not None:
        raise RuntimeError(f"plain workerd exited with {process.returncode}; see {log}")
    return port, process.pid


def sigil_settings(env: dict[str, str]) -> dict:
    """What the bench reads of the settings its Sigil runs with: the workerd binary, and
    whether call records are on."""
    script = (
        "import json; from django.conf import settings; "
        "print(json.dumps({'workerd': settings.SIGIL_WORKERD_BIN, 'records': settings.SIGIL_LOGS_ENABLED}))"
    )
    return json.loads(manage("shell", "-c", script, env=env).strip().splitlines()[-1])


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
    parser.add_argument(
        "--records",
        choices=("on", "off"),
        help="call records (SIGIL_LOGS_ENABLED); by default as the environment says, on if it says nothing",
    )
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
    if args.records:
        env["SIGIL_LOGS_ENABLED"] = "true" if args.records == "on" else "false"
    configured = sigil_settings(env)
    records = "on" if configured["records"] else "off"
    print(f"var dir {var_dir}; call records {records}; load average {load_average()}")

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
        bundle = CodeBundle.from_code(code)
        # The agent's workerd, started by the first deploy.
        agent_workerd = read_status(var_dir / "workerd" / "supervisor.json")["processes"][AGENT]
        backing["workerd"] = agent_workerd["pid"]
        workerd_port = agent_workerd["port"]
        plain_port, plain_pid = start_plain_workerd(
            processes, bundle, binary=configured["workerd"], directory=var_dir / "plain", env=env
        )
        targets = {
            "plain": Target(FLOORS["plain"], f"http://127.0.0.1:{plain_port}/", {}, {"workerd": plain_pid}),
            "loader": Target(
                FLOORS["loader"],
                f"http://127.0.0.1:{workerd_port}/",
                {"X-Sigil-Secret": internal_secret, "X-Sigil-Loader-Id": f"{full}@{bundle.sha}"},
                {"workerd": backing["workerd"]},
            ),
        }
        for server, port in ports.items():
            targets[server] = Target(
                SERVER_LABELS[server],
                f"http://127.0.0.1:{port}/{AGENT}/{CAPABILITY}",
                {"Authorization": f"Bearer {tokens['invoke_token']}"},
                {"server": server_pids[server], **backing},
            )
        check_reply(targets["plain"], plain_port, "/")
        check_reply(targets["loader"], workerd_port, "/")
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
        # the loader host again over fewer connections, at rates like those it serves behind Sigil.
        paced = {n: wrk(targets["loader"], connections=n, seconds=args.seconds) for n in PACED_CONNECTIONS}

        cold = {}
        for server, port in ports.items():
            print(f"cold: {args.cold_runs} deploys through {SERVER_LABELS[server]}", flush=True)
            cold[server] = measure_cold(port, tokens, server=server, runs=args.cold_runs)

    print(f"load average {load_average()} (other work on the machine shows up in the figures)")
    layers = [(server, floor) for server in servers for floor in FLOORS] + [("loader", "plain")]
    over = {(upper, floor): added(latency, throughput, upper, floor) for upper, floor in layers}
    report(servers, targets, latency, throughput, over, cold, args, records)
    report_paced(servers, throughput, paced)
    if args.json:
        raw = {
            "records": records == "on",
            "latency": {name: [vars(load) for load in loads] for name, loads in latency.items()},
            "throughput": {
                name: [vars(load) | {"rps": load.rps} for load in loads] for name, loads in throughput.items()
            },
            # What each adds over a floor, per round: {"granian": {"plain": {...}, "loader": {...}}, "loader": ...}
            "over": {
                upper: {floor: figures for (u, floor), figures in over.items() if u == upper}
                for upper in dict.fromkeys(upper for upper, _ in layers)
            },
            "cold_ms": {server: [vars(call) for call in calls] for server, calls in cold.items()},
            "workers": args.workers,
        }
        args.json.write_text(json.dumps(raw, indent=2))
    shutil.rmtree(var_dir, ignore_errors=True)
    return 0


def added(latency, throughput, upper: str, floor: str) -> dict[str, list[float]]:
    """What target `upper` adds over target `floor` in each round: p50 and p99 in ms, and
    its throughput as a fraction of the floor's."""
    pairs = list(zip(latency[upper], latency[floor], strict=True))
    rates = list(zip(throughput[upper], throughput[floor], strict=True))
    return {
        "added_p50_ms": [mine.p50_ms - theirs.p50_ms for mine, theirs in pairs],
        "added_p99_ms": [mine.p99_ms - theirs.p99_ms for mine, theirs in pairs],
        "throughput_ratio": [mine.rps / theirs.rps for mine, theirs in rates],
    }


def report(servers, targets, latency, throughput, over, cold, args, records) -> None:
    print()
    print(
        f"warm calls, call records {records}: p50/p99 over 1 connection, throughput over "
        f"{THROUGHPUT_CONNECTIONS} connections, {args.seconds:g} s each; {args.workers} worker processes; "
        + ("median (min-max) of " + str(args.rounds) + " rounds" if args.rounds > 1 else "one round")
    )
    print(f"{'':34} {'p50 ms':>18} {'p99 ms':>18} {'req/s':>22}")
    for name, target in targets.items():
        lat, tput = latency[name], throughput[name]
        row = (
            f"{target.label:34} {spread([x.p50_ms for x in lat], 3):>18} {spread([x.p99_ms for x in lat], 3):>18} "
            f"{spread([x.rps for x in tput], 0):>22}"
        )
        failures = sum(x.failures for x in lat + tput)
        if failures:
            row += f"  ({failures} failed requests)"
        print(row)
    print()
    print(f"{'what each adds over a floor':42} {'+p50 ms':>18} {'+p99 ms':>18} {'throughput ratio':>22}")
    for (upper, floor), figures in over.items():
        upper_label = FLOORS[upper] if upper in FLOORS else f"Sigil ({SERVER_LABELS[upper]})"
        label = f"{upper_label} over {OVER_FLOORS[floor]}"
        print(
            f"{label:42} {spread(figures['added_p50_ms'], 3):>18} {spread(figures['added_p99_ms'], 3):>18} "
            f"{spread(figures['throughput_ratio'], 2):>22}"
        )
    print()
    parts = ["server", "workerd", "redis", "wrk"]
    print(
        f"CPU per request over {THROUGHPUT_CONNECTIONS} connections, µs (median);"
        f" the machine has {os.cpu_count()} cores:"
    )
    print(f"{'':34} " + " ".join(f"{part:>9}" for part in [*parts, "total"]))
    for name, target in targets.items():
        cells = []
        for part in parts:
            values = [load.cpu_us[part] for load in throughput[name] if part in load.cpu_us]
            cells.append(f"{statistics.median(values):9.0f}" if values else f"{'-':>9}")
        total = statistics.median(sum(load.cpu_us.values()) for load in throughput[name])
        print(f"{target.label:34} " + " ".join(cells) + f" {total:9.0f}")
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
        f"targets, over the loader host: +p50 <= {MAX_ADDED_P50_MS} ms, +p99 <= {MAX_ADDED_P99_MS} ms, "
        f"ratio >= {MIN_THROUGHPUT_RATIO}, workerd CPU behind Sigil <= {MAX_WORKERD_CPU_RATIO}x alone, "
        f"first call p50 < {MAX_COLD_P50_MS:g} ms"
    )
    loader_cpu = statistics.median(load.cpu_us["workerd"] for load in throughput["loader"])
    for server in servers:
        figures = over[(server, "loader")]
        checks = {
            "+p50": statistics.median(figures["added_p50_ms"]) <= MAX_ADDED_P50_MS,
            "+p99": statistics.median(figures["added_p99_ms"]) <= MAX_ADDED_P99_MS,
            "ratio": statistics.median(figures["throughput_ratio"]) >= MIN_THROUGHPUT_RATIO,
            "workerd cpu": statistics.median(load.cpu_us["workerd"] for load in throughput[server])
            <= MAX_WORKERD_CPU_RATIO * loader_cpu,
            "cold": statistics.median(call.total_ms for call in cold[server]) < MAX_COLD_P50_MS,
        }
        verdict = ", ".join(f"{name} {'ok' if passed else 'MISSED'}" for name, passed in checks.items())
        print(f"{SERVER_LABELS[server]:34} {verdict}")


def report_paced(servers, throughput, paced) -> None:
    print()
    print("the loader host alone over fewer connections (its CPU per call at a lower rate), against behind Sigil:")
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
