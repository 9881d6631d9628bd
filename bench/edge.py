"""Edge benchmark: what Sigil's Worker adds to a warm call it serves, on the emulator.

    .venv/bin/python bench/edge.py [--seconds 5] [--connections 16] [--backends platform,loader]
                                   [--port 0] [--records 1] [--spell 10]

For each runtime it starts Sigil as its owner does (`make -o install run PORT=...`, with
SIGIL_BACKEND set and no CF_API_TOKEN: the bundled Redis, the local Cloudflare emulator, the
edge on, call records on, granian as the origin, Celery with beat publishing the edge's state)
in a fresh temporary var directory, on 127.0.0.1 only. An agent deploys a capability that
answers a short text, and once the edge serves it (its reports reach the origin), the same
warm call is made, `--connections` at a time over kept-alive connections, to:

- `script` (platform only): the capability's own script in the dispatch namespace, as the
  namespace binding calls it (the emulator's `{script}.{namespace}.dispatch.localhost`);
- `dispatch`: Sigil's Worker (the dispatch Worker, the loader Worker) on its secret path,
  with the headers the origin's engine sends it: the straight dispatch, without the edge's
  rules;
- `edge`: Sigil's Worker as callers reach it, with the agent's invoke token (the URL deploy
  answers);
- `origin`: Sigil's server, the Python engine, which calls the dispatch path above.

The targets take one-second turns for `--seconds` each, so that other work on the machine
slows them alike, over one connection (a call that waits behind none) and over
`--connections`. Each prints p50 and p99 of every call's time, its calls per second and the
CPU the origin's processes (runsigil, Redis, granian, Celery) and the emulator's (its Python
front and its workerd processes) spent per call, read from /proc; then the edge's added p50
and throughput ratio over the straight dispatch, against the targets. Last, the origin's CPU
per call served at the edge: the origin idle for `--spell` seconds, then the edge alone
called for as long, each followed by the time the edge's reports take to arrive; the
difference, over the calls (what the origin spends applying the edge's reports, and keeping
the calls' records, which Sigil's Workers push to it). The load comes from this process, on
the same cores.

It stops everything it started, by its process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import harness

from capabilities.engine.upstream import UpstreamClient, UpstreamTimeout, UpstreamUnreachable
from sigil import redis_keys
from sigil.ports import free_port_block

AGENT = "bench"
NAME = "hello"
REPLY = "hello from a capability"
CODE = f"export default {{ async fetch() {{ return new Response({json.dumps(REPLY)}) }} }}"
RUNNING = "Sigil is running at"
NAMESPACE = "sigil"  # SIGIL_PLATFORM_NAMESPACE's default

# The targets of issue 29: the edge adds at most this much p50 over the straight dispatch, and
# keeps at least this share of its throughput.
MAX_ADDED_P50_MS = 0.5
MIN_THROUGHPUT_RATIO = 0.6

# The runtime's route, as the origin's engine builds it (the headers its Worker's secret path needs).
ROUTE = f"""
import json
from capabilities.books import routes
from capabilities.runtimes import get_runtime
cached = routes.decode(routes.route_load("{AGENT}--{NAME}"))
route = get_runtime().route(slot=cached.slot, sha=cached.sha, tenant=cached.agent, cpu_ms=cached.cpu_ms)
print(json.dumps({{"base_url": route.base_url, "headers": list(route.headers), "host": route.host_header}}))
"""

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User and system CPU seconds of one process, from /proc (Linux); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def children(pid: int) -> list[int]:
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(child) for child in (task / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


def descendants(pid: int) -> list[int]:
    return [pid, *(grandchild for child in children(pid) for grandchild in descendants(child))]


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def part_of(command: str) -> str:
    """Which part of Sigil a child of runsigil is: the origin's (redis, web, celery) or the
    emulator (Cloudflare, with its workerd processes)."""
    if "granian" in command:
        return "web"
    if "celery" in command:
        return "celery"
    if "redis-server" in command:
        return "redis"
    return "emulator"


@dataclass
class Parts:
    """The pids of each part, found under `make run`'s process (read again before each reading:
    granian and workerd may start processes later)."""

    make_pid: int

    def pids(self) -> dict[str, list[int]]:
        parts: dict[str, list[int]] = {"runsigil": [], "web": [], "celery": [], "redis": [], "emulator": []}
        for runsigil in children(self.make_pid):
            parts["runsigil"].append(runsigil)
            for child in children(runsigil):
                parts[part_of(command_line(child))] += descendants(child)
        return parts

    def cpu(self) -> dict[str, float]:
        return {part: sum(process_cpu(pid) for pid in pids) for part, pids in self.pids().items()}


ORIGIN_PARTS = ("runsigil", "web", "celery", "redis")


@dataclass(frozen=True)
class Target:
    label: str
    url: str
    headers: dict[str, str]


@dataclass
class Load:
    """What the calls of one target gave, over all its turns."""

    latencies: list[float] = field(default_factory=list)  # seconds, of the calls answered 200
    failures: dict[int, int] = field(default_factory=dict)  # by status; 0: no answer
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds, by part

    @property
    def calls(self) -> int:
        return len(self.latencies) + sum(self.failures.values())

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def p(self, fraction: float) -> float:
        return harness.percentile(self.latencies, fraction) * 1000

    def cpu_us(self, parts) -> float:
        return sum(self.cpu.get(part, 0.0) for part in parts) / max(self.calls, 1) * 1e6


async def turn(client: UpstreamClient, target: Target, load: Load, *, connections: int, seconds: float) -> None:
    """`connections` callers of `target`, each calling again as soon as it has its answer, for `seconds`."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds

    async def caller() -> None:
        while loop.time() < until:
            started = time.perf_counter()
            try:
                response = await client.request("GET", target.url, headers=dict(target.headers), body=None)
                body = await response.read()
                response.release()
                status = response.status if body == REPLY.encode() or response.status != 200 else -1
            except (UpstreamTimeout, UpstreamUnreachable):
                status = 0
            if status == 200:
                load.latencies.append(time.perf_counter() - started)
            else:
                load.failures[status] = load.failures.get(status, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(connections)))
    load.seconds += time.perf_counter() - started


async def interleaved(
    targets: list[Target], parts: Parts, *, connections: int, seconds: float, warm: Load
) -> dict[str, Load]:
    """Each target called in one-second turns, taken in turn with the others', `seconds` turns
    each, after a short turn each that opens the connections (its calls of the edge in `warm`)."""
    clients = {target.label: UpstreamClient(connect_timeout=5.0, read_timeout=30.0) for target in targets}
    loads = {target.label: Load() for target in targets}
    for target in targets:
        opening = warm if target.label == "edge" else Load()
        await turn(clients[target.label], target, opening, connections=connections, seconds=0.3)
    for _ in range(max(1, round(seconds))):
        for target in targets:
            before = parts.cpu()
            await turn(clients[target.label], target, loads[target.label], connections=connections, seconds=1.0)
            after = parts.cpu()
            for part, used in after.items():
                loads[target.label].cpu[part] = loads[target.label].cpu.get(part, 0.0) + used - before.get(part, 0.0)
    for client in clients.values():
        await client.close()
    return loads


class Owner:
    """The owner's terminal: `make run` in a process group of its own, Ctrl-C to stop it."""

    def __init__(self, port: int, env: dict[str, str], log_path: Path) -> None:
        self.port, self.env, self.log_path = port, env, log_path
        self.make: subprocess.Popen | None = None

    def make_run(self) -> None:
        command = ["make", "--no-print-directory", "-o", "install", "run", f"PORT={self.port}"]
        with open(self.log_path, "ab") as log:
            self.make = subprocess.Popen(
                command, cwd=harness.ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

        def said() -> bool:
            if self.make.poll() is not None:
                raise RuntimeError(f"make run exited with {self.make.returncode}; see {self.log_path}")
            return RUNNING in self.log_path.read_text(errors="replace")

        harness.wait_until(said, "Sigil did not say it runs", seconds=240)

    def ctrl_c(self) -> None:
        """SIGINT to the process group, as a terminal sends it; what is left after a minute is killed."""
        if self.make is None:
            return
        if self.make.poll() is None:
            os.killpg(self.make.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.make.wait(timeout=60)
        harness.stop(self.make)


class EdgeSigil:
    """One Sigil on `backend` under `make run`, the agent's capability `hello` deployed, and the targets."""

    def __init__(self, processes: harness.Processes, backend: str, *, port: int, records: bool) -> None:
        import redis

        self.backend = backend
        self.var_dir = harness.fresh_var_dir(f"edge-{backend}")
        env = harness.sigil_environment(
            self.var_dir,
            own_redis=True,
            SIGIL_BACKEND=backend,
            SIGIL_EDGE="true",
            SIGIL_LOGS_ENABLED="true" if records else "false",
        )
        for name in ("CF_API_TOKEN", "CF_API_BASE", "CF_ACCOUNT_ID", "CF_EMULATOR_PORT", "SIGIL_WORKERD_PORT"):
            env.pop(name, None)  # the emulator's account, on the ports that follow from PORT
        for name in ("SIGIL_CF_WORKERS_BASE", "SIGIL_ORIGIN_URL", "SIGIL_EDGE_URL"):
            env.pop(name, None)
        self.owner = Owner(port, env, self.var_dir / "make-run.log")
        processes.adopt(self.owner.ctrl_c)
        self.owner.make_run()
        self.parts = Parts(self.owner.make.pid)
        self.env = {**env, "REDIS_URL": f"unix://{self.var_dir / 'redis.sock'}"}  # runsigil's bundled Redis
        self.redis = redis.Redis(unix_socket_path=str(self.var_dir / "redis.sock"))
        tokens = json.loads(harness.manage("createagent", AGENT, "--json", env=self.env))
        self.invoke = harness.bearer(tokens["invoke_token"])
        emulator_port = json.loads((self.var_dir / "ports.json").read_text())["cfemulator"]
        # KV delivers what is published at once (Cloudflare: up to 60 s), so the edge serves soon.
        emulator = http.client.HTTPConnection("127.0.0.1", emulator_port, timeout=30)
        changes = json.dumps({"kv_miss_cache_seconds": 0, "kv_propagation_seconds": 0})
        response, body = harness.request(
            emulator, "POST", "/__emulator/config", headers={"Content-Type": "application/json"}, body=changes
        )
        if response.status != 200:
            raise RuntimeError(f"the emulator's config answered {response.status}: {body[:300]!r}")
        emulator.close()
        self.emulator = f"http://127.0.0.1:{emulator_port}"

        self.port, self.deploy_token = port, tokens["deploy_token"]
        self.deploy_ms, self.edge_url = self.deploy(NAME, CODE)
        self.origin_url = f"http://127.0.0.1:{port}/{AGENT}/{NAME}"
        self.route = json.loads(harness.manage("shell", "-c", ROUTE, env=self.env).strip().splitlines()[-1])

    def deploy(self, name: str, code: str, **fields) -> tuple[float, str]:
        """Deploy `name` over the REST API: (ms until it answered 201, the URL it answered)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {**harness.bearer(self.deploy_token), "Content-Type": "application/json"}
        deploying = time.perf_counter()
        response, body = harness.request(
            connection, "POST", "/_api/deploy", headers=headers, body=json.dumps({"name": name, "code": code, **fields})
        )
        took = (time.perf_counter() - deploying) * 1000
        connection.close()
        if response.status != 201:
            raise RuntimeError(f"deploy of {name} on {self.backend}: {response.status} {body[:300]!r}")
        return took, json.loads(body)["url"]

    def targets(self) -> list[Target]:
        path = f"/{AGENT}/{NAME}"
        route_headers = dict(self.route["headers"])
        if self.route["host"]:
            route_headers["host"] = self.route["host"]
        targets = []
        if self.backend == "platform":
            host = f"{AGENT}--{NAME}.{NAMESPACE}.dispatch.localhost"
            targets.append(Target("script", f"{self.emulator}{path}", {"host": host}))
        targets += [
            Target("dispatch", f"{self.route['base_url']}{path}", route_headers),
            Target("edge", self.edge_url, self.invoke),
            Target("origin", self.origin_url, self.invoke),
        ]
        return targets

    def applied(self) -> int:
        return int(self.redis.hget(redis_keys.EDGE_REPORTS, "applied") or 0)

    def wait_for_the_edge(self, edge_url: str = "", *, patience: float = 90.0) -> None:
        """Call `edge_url` (the capability `hello`'s) until a call is reported by the edge
        (served there, not handed to the origin)."""
        url = urlsplit(edge_url or self.edge_url)
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            before = self.applied()
            connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
            response, _ = harness.request(connection, "GET", url.path, headers=self.invoke)
            connection.close()
            if response.status != 200:
                raise RuntimeError(f"the edge answered {response.status}")
            reported = time.monotonic() + 3
            while time.monotonic() < reported:
                if self.applied() > before:
                    return
                time.sleep(0.05)
        raise RuntimeError(f"the edge did not serve {url.path} within {patience:g} s on {self.backend}")

    def reports_settled(self, *, quiet: float = 2.0, patience: float = 60.0) -> int:
        """The reports applied once none has arrived for `quiet` seconds."""
        deadline = time.monotonic() + patience
        last, since = self.applied(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.applied()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return now
        return last

    def origin_cost(self, edge: Target, *, connections: int, seconds: float) -> OriginCost:
        """The origin's CPU idle for `seconds`, then with the edge called for as long, each
        spell followed by the settling of the edge's reports."""
        self.reports_settled()
        before = self.parts.cpu()
        time.sleep(seconds)
        self.reports_settled()
        idle = self.parts.cpu()
        applied = self.applied()

        async def called() -> Load:
            client = UpstreamClient(connect_timeout=5.0, read_timeout=30.0)
            load = Load()
            await turn(client, edge, load, connections=connections, seconds=seconds)
            await client.close()
            return load

        load = asyncio.run(called())
        reported = self.reports_settled() - applied
        busy = self.parts.cpu()
        return OriginCost(
            idle={part: idle[part] - before[part] for part in ORIGIN_PARTS},
            busy={part: busy[part] - idle[part] for part in ORIGIN_PARTS},
            calls=load.calls,
            reported=reported,
        )


@dataclass(frozen=True)
class OriginCost:
    idle: dict[str, float]  # CPU seconds by part, the origin idle
    busy: dict[str, float]  # the same, the edge called for as long
    calls: int
    reported: int

    def per_call_us(self, part: str) -> float:
        return (self.busy[part] - self.idle[part]) / max(self.calls, 1) * 1e6


def verdict(met: bool) -> str:
    return "met" if met else "not met"


def main() -> int:
    args = harness.options(
        __doc__,
        seconds=(5.0, "one-second turns per target, at each concurrency"),
        connections=16,
        backends=("platform,loader", "the runtimes to measure, comma-separated (platform, loader)"),
        port=(0, "the web server's PORT (the emulator's and workerd's follow from it); 0: a free one"),
        records=(1, "1: call records on (Sigil's default), 0: off"),
        spell=(10.0, "seconds of each spell of the origin's CPU: idle, then the edge called"),
    )
    print(f"load average {harness.load_average()}; call records {'on' if args.records else 'off'}")
    failed = False
    with harness.Processes() as processes:
        for backend in args.backends.split(","):
            # Below the ephemeral ports, as the ports that follow from it must be.
            port = args.port or free_port_block()
            bench = EdgeSigil(processes, backend, port=port, records=bool(args.records))
            print(f"{backend}: var dir {bench.var_dir}; deploy answered 201 in {bench.deploy_ms:.0f} ms")
            bench.wait_for_the_edge()
            targets = bench.targets()
            edge_target = next(target for target in targets if target.label == "edge")
            applied = bench.applied()
            warm = Load()
            runs = {
                connections: asyncio.run(
                    interleaved(targets, bench.parts, connections=connections, seconds=args.seconds, warm=warm)
                )
                for connections in (1, args.connections)
            }
            reported = bench.reports_settled() - applied
            made = warm.calls + sum(loads["edge"].calls for loads in runs.values())
            cost = bench.origin_cost(edge_target, connections=args.connections, seconds=args.spell)
            bench.owner.ctrl_c()
            print(f"{backend}: load average {harness.load_average()}")
            for connections, loads in runs.items():
                print(f"  {connections} connection{'s' if connections > 1 else ''}:")
                for target in targets:
                    load = loads[target.label]
                    failures = f", failed {load.failures}" if load.failures else ""
                    print(
                        f"    {target.label:8} p50 {load.p(0.5):6.2f} ms  p99 {load.p(0.99):6.2f} ms  "
                        f"{load.rate:6.0f} calls/s  CPU per call: origin {load.cpu_us(ORIGIN_PARTS):5.0f} µs "
                        f"(web {load.cpu_us(['web']):.0f}, celery {load.cpu_us(['celery']):.0f}, "
                        f"redis {load.cpu_us(['redis']):.0f}), emulator {load.cpu_us(['emulator']):5.0f} µs{failures}"
                    )
                    failed |= bool(load.failures)
                edge, dispatch = loads["edge"], loads["dispatch"]
                added = edge.p(0.5) - dispatch.p(0.5)
                ratio = edge.rate / dispatch.rate
                print(
                    f"    the edge over the straight dispatch: p50 {added:+.2f} ms (target <= {MAX_ADDED_P50_MS} ms: "
                    f"{verdict(added <= MAX_ADDED_P50_MS)}), p99 {edge.p(0.99) - dispatch.p(0.99):+.2f} ms, "
                    f"throughput {ratio:.2f}x (target >= {MIN_THROUGHPUT_RATIO}x: "
                    f"{verdict(ratio >= MIN_THROUGHPUT_RATIO)})"
                )
                if "script" in loads:
                    script = loads["script"]
                    print(
                        f"    over the script alone: the edge p50 {edge.p(0.5) - script.p(0.5):+.2f} ms, "
                        f"throughput {edge.rate / script.rate:.2f}x; the dispatch Worker's secret path "
                        f"p50 {dispatch.p(0.5) - script.p(0.5):+.2f} ms, throughput {dispatch.rate / script.rate:.2f}x"
                    )
                origin = loads["origin"]
                print(
                    f"    the origin against the edge: p50 {origin.p(0.5) - edge.p(0.5):+.2f} ms, "
                    f"throughput {origin.rate / edge.rate:.2f}x"
                )
            print(f"  edge calls reported to the origin: {reported} of the {made} made")
            parts = ", ".join(f"{part} {cost.per_call_us(part):.0f}" for part in ORIGIN_PARTS)
            total = sum(cost.per_call_us(part) for part in ORIGIN_PARTS)
            print(
                f"  the origin's CPU per call served at the edge: {total:.0f} µs ({parts}); "
                f"{args.spell:g} s idle {sum(cost.idle.values()) * 1000:.0f} ms, {args.spell:g} s of "
                f"{cost.calls} edge calls {sum(cost.busy.values()) * 1000:.0f} ms, {cost.reported} reports applied"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
