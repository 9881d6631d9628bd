"""Records cost benchmark: the CPU each process spends per warm call with call records on
against off, on the local runtime.

    .venv/bin/python bench/records_cost.py [--rounds 3] [--seconds 5] [--connections 16]

It starts two Sigils on 127.0.0.1, each in a fresh temporary var directory with its own
bundled Redis, workerd with the loader host under `manage.py runworkerd` (and, with records
on, the log sink in that process) and granian with its worker processes: one as `make run`
has it (records on), one with SIGIL_LOGS_ENABLED=false. It deploys the invoke benchmark's
capability on each, then, `--rounds` times and alternating between the two so that other
work on the machine slows both alike, calls it with wrk for `--seconds` over `--connections`
keep-alive connections (a second's warm-up first), and over one connection for the p50. It
reads from /proc the CPU time (user and system) each part used during the loaded run:

- server: granian's master and its worker processes (the engine, Django, the upstream call);
- workerd: the agent's workerd process (the loader host, the capability, its tail and the
  records' channel);
- sink: runworkerd's own process, without its workerd children (its supervision, and with
  records on the log sink's HTTP server and what it keeps in Redis);
- redis: the Redis server;

and prints each part's CPU per call, records on and off, and the difference: what records
cost a call, process by process. A turn's records reach the sink up to 50 ms after its last
call, so each reading is taken a moment after wrk ends (the same for both). Linux only.
It stops everything it started, by pid.
"""

from __future__ import annotations

import http.client
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import harness
from invoke import CODE, LATENCY_LUA, REPLY, THROUGHPUT_LUA, Target, check_reply, cpu_seconds, wrk

from capabilities.workerd.group import read_status
from capabilities.workerd.supervision import process_cpu_ms
from sigil.ports import free_port, free_port_block
from testsupport.servers import server_command

AGENT = "bench"
CAPABILITY = "hello"
PARTS = ("server", "workerd", "sink", "redis")
# After wrk ends: the channel's last batch (sent 50 ms after a call) and the sink's work on it.
SETTLE_SECONDS = 0.3


@dataclass
class Stack:
    """One Sigil: the pids whose CPU is read, and the call wrk makes."""

    label: str
    var_dir: Path
    pids: dict[str, int]
    target: Target
    port: int

    def cpu_seconds(self) -> dict[str, float]:
        own = process_cpu_ms(self.pids["sink"]) or 0.0
        return {
            "server": cpu_seconds(self.pids["server"]),
            "workerd": cpu_seconds(self.pids["workerd"]),
            "sink": own / 1000,
            "redis": cpu_seconds(self.pids["redis"]),
        }


def start_stack(processes: harness.Processes, *, records: bool, workers: int) -> Stack:
    label = "on" if records else "off"
    var_dir = harness.fresh_var_dir(f"records-{label}")
    env = harness.sigil_environment(
        var_dir, SIGIL_WORKERD_PORT=str(free_port_block()), SIGIL_LOGS_ENABLED="true" if records else "false"
    )
    env.pop("REDIS_URL", None)  # each Sigil its own Redis, so that each one's CPU is its own
    redis_pid = processes.redis_unless_given(env, var_dir)
    runworkerd = processes.workerd(env, var_dir)
    harness.manage("migrate", "--noinput", env=env)
    tokens = json.loads(harness.manage("createagent", AGENT, "--json", env=env))
    port = free_port()
    server = processes.start(
        server_command("granian", port=port, workers=workers), env=env, log=var_dir / "granian.log"
    )
    harness.wait_for_health(port, server)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    harness.deploy(connection, tokens["deploy_token"], CAPABILITY, CODE % json.dumps(REPLY))
    connection.close()
    agent_workerd = read_status(var_dir / "workerd" / "supervisor.json")["processes"][AGENT]
    pids = {"server": server.pid, "workerd": agent_workerd["pid"], "sink": runworkerd.pid, "redis": redis_pid}
    target = Target(
        f"records {label}",
        f"http://127.0.0.1:{port}/{AGENT}/{CAPABILITY}",
        harness.bearer(tokens["invoke_token"]),
        {},
    )
    check_reply(target, port, f"/{AGENT}/{CAPABILITY}")
    return Stack(label, var_dir, pids, target, port)


def loaded_run(stack: Stack, *, connections: int, seconds: float) -> tuple[int, float, dict[str, float]]:
    """One wrk run: calls made, calls per second and each part's CPU µs per call."""
    before = stack.cpu_seconds()
    load = wrk(stack.target, connections=connections, seconds=seconds, script=THROUGHPUT_LUA)
    time.sleep(SETTLE_SECONDS)
    after = stack.cpu_seconds()
    if load.failures:
        raise RuntimeError(f"{load.failures} calls failed with records {stack.label}")
    return load.requests, load.rps, {part: (after[part] - before[part]) / load.requests * 1e6 for part in PARTS}


def main() -> int:
    args = harness.options(
        __doc__,
        rounds=(3, "loaded runs per Sigil, alternating"),
        seconds=(5.0, "duration of each wrk run"),
        connections=(16, "keep-alive connections of the loaded run"),
        workers=(2, "granian worker processes"),
    )
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    print(f"load average {harness.load_average()}")
    runs: dict[str, list[tuple[int, float, dict[str, float]]]] = {"on": [], "off": []}
    p50: dict[str, list[float]] = {"on": [], "off": []}
    with harness.Processes() as processes:
        stacks = [start_stack(processes, records=True, workers=args.workers)]
        stacks.append(start_stack(processes, records=False, workers=args.workers))
        for round_number in range(args.rounds):
            for stack in stacks:
                print(f"round {round_number + 1}/{args.rounds}: records {stack.label}", flush=True)
                wrk(stack.target, connections=args.connections, seconds=1)
                runs[stack.label].append(loaded_run(stack, connections=args.connections, seconds=args.seconds))
                p50[stack.label].append(
                    wrk(stack.target, connections=1, seconds=min(args.seconds, 3), script=LATENCY_LUA).p50_ms
                )
        for stack in stacks:
            shutil.rmtree(stack.var_dir, ignore_errors=True)
    print(f"load average {harness.load_average()}")
    print()
    print(
        f"CPU per call over {args.connections} connections, µs (median of {args.rounds} runs of "
        f"{args.seconds:g} s); p50 over 1 connection"
    )
    print(f"{'records':8} {'calls/s':>8} {'p50 ms':>7} " + " ".join(f"{part:>8}" for part in [*PARTS, "total"]))
    medians = {}
    for label in ("on", "off"):
        cells = {part: statistics.median(run[2][part] for run in runs[label]) for part in PARTS}
        cells["total"] = statistics.median(sum(run[2].values()) for run in runs[label])
        medians[label] = cells
        rate = statistics.median(run[1] for run in runs[label])
        print(
            f"{label:8} {rate:8.0f} {statistics.median(p50[label]):7.3f} "
            + " ".join(f"{cells[part]:8.1f}" for part in [*PARTS, "total"])
        )
    difference = {part: medians["on"][part] - medians["off"][part] for part in [*PARTS, "total"]}
    added = statistics.median(p50["on"]) - statistics.median(p50["off"])
    print(f"{'on - off':8} {'':>8} {added:+7.3f} " + " ".join(f"{difference[p]:+8.1f}" for p in [*PARTS, "total"]))
    for label in ("on", "off"):
        print(
            f"  records {label}, each run: "
            + "; ".join(
                f"{rps:.0f}/s " + " ".join(f"{part} {cpu[part]:.0f}" for part in PARTS) for _, rps, cpu in runs[label]
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
