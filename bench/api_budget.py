"""API budget benchmark: what ordinary traffic costs of Cloudflare's API budget, on each runtime.

    .venv/bin/python bench/api_budget.py [--minutes 10] [--rate 10] [--runtimes worker-pool,platform,loader]

Each runtime runs as a user runs it: `make -o install run PORT=...` (`install` is skipped, it
has nothing to do on an installed machine) with SIGIL_BACKEND set, in a fresh temporary var
directory with its bundled Redis, on the Cloudflare emulator `make run` starts without
CF_API_TOKEN, with the defaults: call records on, the edge on, the default API budget
(SIGIL_CF_RATE_LIMIT per SIGIL_CF_RATE_WINDOW_SECONDS), beat's own schedule. The runtimes run
side by side, each on its own ports.

On each, an agent deploys `steady` and `cold`, the owner pages `cold` out, and a caller calls
`steady` at `--rate` calls a second for `--minutes` minutes. Then, right after the traffic, a
deploy of a new capability and a call to `cold` (its page-in) are timed.

It prints, per runtime, the Cloudflare API requests the traffic's window cost per 1,000 calls,
by the class of work they were made for and by operation (Sigil's own count, from /metrics),
beside what the emulator recorded receiving in the same window (every request that reached it);
the calls by status; the call record batches pushed to the origin; and the deploy's and the
page-in's status, time and API requests.
"""

from __future__ import annotations

import http.client
import json
import re
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import harness
from runtime_switch import AGENT, CODE, RUNNING, Caller

RUNTIMES = ("worker-pool", "platform", "loader")
# The web ports, one a runtime; the emulator and the local workerd's ports follow each (set
# here, not derived: they stay within the block).
FIRST_PORT = 8100
PORT_STEP = 20
# How long after a deploy or a page-in its API requests are counted: the edge's state is
# published by beat every SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS (3 s).
SETTLE_SECONDS = 5.0
METRIC = re.compile(r'^(sigil_cloudflare_api_calls_by_(class|operation)_total)\{\w+="([^"]+)"\} (\d+)$')
TOTAL = re.compile(r"^(sigil_cloudflare_api_calls_total|sigil_call_record_pushes_total\{taken=\"first\"\}) (\d+)$")


@dataclass
class Counts:
    """Sigil's count of its API requests (by class, by operation, in all), and the call record
    batches pushed to it, at one moment."""

    by_class: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    total: int = 0
    pushes: int = 0

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.by_class - other.by_class,
            self.by_operation - other.by_operation,
            self.total - other.total,
            self.pushes - other.pushes,
        )


@dataclass
class Timed:
    status: int
    seconds: float
    spent: Counts  # all of Sigil's API requests from its start to SETTLE_SECONDS after
    cold: bool = False


@dataclass
class Result:
    runtime: str
    calls: Counter = field(default_factory=Counter)
    traffic_seconds: float = 0.0
    traffic: Counts | None = None
    emulator_requests: Counter = field(default_factory=Counter)  # by "METHOD path-shape"
    deploy: Timed | None = None
    page_in: Timed | None = None
    error: str | None = None


class Sigil:
    """One runtime's Sigil under `make run`, its emulator beside it."""

    def __init__(self, runtime: str, port: int) -> None:
        self.runtime, self.port = runtime, port
        self.metrics_token = secrets.token_urlsafe(16)
        self.var_dir = harness.fresh_var_dir(f"api-budget-{runtime}")
        self.env = harness.sigil_environment(
            self.var_dir,
            own_redis=True,
            SIGIL_BACKEND=runtime,
            CF_EMULATOR_PORT=str(port + 1),
            SIGIL_WORKERD_PORT=str(port + 2),
            SIGIL_METRICS_TOKEN=self.metrics_token,
            SIGIL_LOG_LEVEL="INFO",
        )
        for name in ("CF_API_TOKEN", "CF_API_BASE", "SIGIL_CF_RATE_LIMIT", "SIGIL_CF_RATE_WINDOW_SECONDS"):
            self.env.pop(name, None)  # the emulator, and the default budget
        self.log = self.var_dir / "make-run.log"
        self.make: subprocess.Popen | None = None

    def start(self) -> None:
        command = ["make", "--no-print-directory", "-o", "install", "run", f"PORT={self.port}"]
        with open(self.log, "ab") as log:
            self.make = subprocess.Popen(
                command, cwd=harness.ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

        def said() -> bool:
            if self.make.poll() is not None:
                raise RuntimeError(f"make run exited with {self.make.returncode}; see {self.log}")
            return RUNNING in self.log.read_text(errors="replace")

        harness.wait_until(said, f"{self.runtime}: Sigil did not say it runs", seconds=240)

    def stop(self) -> None:
        """Ctrl-C, as a terminal sends it, to make run's process group; then wait for it."""
        import os
        import signal

        if self.make is not None and self.make.poll() is None:
            os.killpg(self.make.pid, signal.SIGINT)
            try:
                self.make.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.make.pid, signal.SIGKILL)

    def manage(self, *args: str) -> str:
        return harness.manage(*args, env=self.env)

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def counts(self) -> Counts:
        connection = self.connection()
        try:
            response, body = harness.request(connection, "GET", "/metrics", headers=harness.bearer(self.metrics_token))
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"{self.runtime}: /metrics answered {response.status}")
        counts = Counts()
        for line in body.decode().splitlines():
            if match := METRIC.match(line):
                kind, label, value = match.group(2), match.group(3), int(match.group(4))
                (counts.by_class if kind == "class" else counts.by_operation)[label] = value
            elif match := TOTAL.match(line):
                if match.group(1).startswith("sigil_cloudflare"):
                    counts.total = int(match.group(2))
                else:
                    counts.pushes = int(match.group(2))
        return counts

    def emulator_requests(self, since: float, until: float) -> Counter:
        """What the emulator received between the two moments (epoch), by method and the
        path's shape (ids and names left out)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port + 1, timeout=30)
        try:
            _, body = harness.request(connection, "GET", "/__emulator/requests")
        finally:
            connection.close()
        shapes = Counter()
        for entry in json.loads(body)["requests"]:
            if since <= entry["time"] < until:
                shapes[f"{entry['method']} {path_shape(entry['path'])}"] += 1
        return shapes


def path_shape(path: str) -> str:
    """`path` without the account and the names and ids in it."""
    parts = path.split("/client/v4/", 1)[-1].split("/")
    kept = []
    for index, part in enumerate(parts):
        previous = parts[index - 1] if index else ""
        named = previous in ("accounts", "scripts", "namespaces", "dispatch", "values", "keys")
        kept.append("*" if named and part not in ("namespaces",) else part)
    return "/".join(kept)


def deploy_timed(sigil: Sigil, token: str, name: str) -> Timed:
    before = sigil.counts()
    body = json.dumps({"name": name, "code": CODE % json.dumps(name)}).encode()
    headers = {**harness.bearer(token), "Content-Type": "application/json"}
    connection = sigil.connection()
    started = time.monotonic()
    try:
        response, _ = harness.request(connection, "POST", "/_api/deploy", headers=headers, body=body)
    finally:
        connection.close()
    took = time.monotonic() - started
    time.sleep(max(0.0, SETTLE_SECONDS - took))
    return Timed(response.status, took, sigil.counts() - before)


def call_timed(sigil: Sigil, token: str, name: str) -> Timed:
    before = sigil.counts()
    connection = sigil.connection()
    started = time.monotonic()
    try:
        response, _ = harness.request(connection, "GET", f"/{AGENT}/{name}", headers=harness.bearer(token))
    finally:
        connection.close()
    took = time.monotonic() - started
    cold = response.getheader("X-Sigil-Cold-Start") == "1"
    time.sleep(max(0.0, SETTLE_SECONDS - took))
    return Timed(response.status, took, sigil.counts() - before, cold=cold)


def run(runtime: str, port: int, *, minutes: float, rate: float, result: Result) -> None:
    sigil = Sigil(runtime, port)
    try:
        sigil.start()
        tokens = json.loads(sigil.manage("createagent", AGENT, "--json"))
        connection = sigil.connection()
        for name in ("steady", "cold"):
            harness.deploy(connection, tokens["deploy_token"], name, CODE % json.dumps(name))
        connection.close()
        # The owner's "evict" (the admin's action), as the admin runs it.
        sigil.manage(
            "shell",
            "-c",
            f"from capabilities import services; services.capability_evict(full='{AGENT}--cold', actor='owner:bench')",
        )
        time.sleep(10)  # what the deploys and the page-out left to do, done before the window
        before, since = sigil.counts(), time.time()
        started = time.monotonic()
        with Caller(port, tokens["invoke_token"], ["steady"], rate=rate) as caller:
            time.sleep(minutes * 60)
        result.traffic_seconds = time.monotonic() - started
        until = time.time()
        result.traffic = sigil.counts() - before
        result.emulator_requests = sigil.emulator_requests(since, until)
        result.calls = Counter(answer.status for answer in caller.answers)
        result.deploy = deploy_timed(sigil, tokens["deploy_token"], "fresh")
        result.page_in = call_timed(sigil, tokens["invoke_token"], "cold")
    except Exception as exc:  # reported with the other runtimes' figures
        result.error = f"{type(exc).__name__}: {exc} (see {sigil.log})"
    finally:
        sigil.stop()
        print(f"{runtime}: make run's output {sigil.log}", flush=True)


def per_thousand(count: int, calls: int) -> str:
    return f"{count * 1000 / calls:.1f}" if calls else "-"


def report(result: Result) -> bool:
    """Print `result`; whether it met the targets (every call 200, the deploy 201, the page-in
    a cold 200)."""
    print(f"\n{result.runtime}:")
    if result.error:
        print(f"  failed: {result.error}")
        return False
    calls = sum(result.calls.values())
    statuses = ", ".join(f"{status or 'none'}: {count}" for status, count in sorted(result.calls.items()))
    rate = calls / result.traffic_seconds
    print(f"  {calls} calls in {result.traffic_seconds:.0f} s ({rate:.1f}/s); by status: {statuses}")
    traffic = result.traffic
    print(
        f"  API requests in the traffic's window: {traffic.total} "
        f"({per_thousand(traffic.total, calls)} per 1,000 calls); call record batches pushed: {traffic.pushes}"
    )
    for label, counts in (("by class", traffic.by_class), ("by operation", traffic.by_operation)):
        spent = ", ".join(
            f"{name} {count} ({per_thousand(count, calls)}/1,000)" for name, count in sorted(counts.items()) if count
        )
        print(f"    {label}: {spent or 'none'}")
    received = sum(result.emulator_requests.values())
    shapes = ", ".join(f"{shape} {count}" for shape, count in result.emulator_requests.most_common())
    print(f"  the emulator received {received} in the window: {shapes or 'none'}")
    for what, timed in (("deploy right after", result.deploy), ("page-in right after", result.page_in)):
        cold = " (cold start)" if timed.cold else ""
        spent = timed.spent
        classes = ", ".join(f"{name} {count}" for name, count in sorted(spent.by_class.items()) if count)
        operations = ", ".join(f"{name} {count}" for name, count in sorted(spent.by_operation.items()) if count)
        print(
            f"  {what}: {timed.status}{cold} in {timed.seconds * 1000:.0f} ms; all of Sigil's API requests "
            f"within {SETTLE_SECONDS:g} s of its start: {spent.total} (by class: {classes or 'none'}; "
            f"by operation: {operations or 'none'})"
        )
    return (
        set(result.calls) == {200}
        and result.deploy.status == 201
        and (result.page_in.status, result.page_in.cold) == (200, True)
    )


def main() -> int:
    args = harness.options(
        __doc__,
        minutes=(10.0, "minutes of traffic on each runtime"),
        rate=(10.0, "calls a second"),
        runtimes=(",".join(RUNTIMES), "the runtimes, run side by side"),
    )
    runtimes = [name for name in args.runtimes.split(",") if name]
    print(f"load average {harness.load_average()}; {args.rate:g} calls/s for {args.minutes:g} min on {runtimes}")
    results = [Result(runtime) for runtime in runtimes]
    threads = [
        threading.Thread(
            target=run,
            args=(runtime, FIRST_PORT + PORT_STEP * index),
            kwargs={"minutes": args.minutes, "rate": args.rate, "result": result},
        )
        for index, (runtime, result) in enumerate(zip(runtimes, results, strict=True))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"load average after {harness.load_average()}")
    met = [report(result) for result in results]
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
