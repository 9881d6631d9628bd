"""Edge reports benchmark: how late the origin sees a call served at the edge, on the emulator.

    .venv/bin/python bench/edge_reports.py [--calls 40] [--rounds 3] [--kv-propagation 0]
                                           [--backends worker-pool,platform,loader]

For each Cloudflare runtime it runs all of Sigil as `make run` does against the local
Cloudflare emulator (`manage.py runsigil`: the bundled Redis, the emulator, a Celery worker
with beat publishing the edge's state every SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS, granian as the
origin), in a fresh temporary var directory, on 127.0.0.1 only, with the edge on. The
emulator's KV keeps a location's read `--kv-propagation` seconds (Cloudflare: up to 60) and
caches no miss, so that the edge serves what was just published. Then, at the edge's URL:

1. counted: `--calls` calls one at a time, a success and a capability's own 500 in turn (a
   success between two failures keeps the breaker closed), each followed by polling Redis
   (every 2 ms) until the origin has applied its report: p50, p99 and the worst of the time
   from the call's answer to its counters at the origin, for successes (batched: about a
   second) and failures (pushed at once);
2. breaker: `--rounds` times, a capability that throws is called until its failures reach
   SIGIL_BREAKER_THRESHOLD, then the time from the last failure's answer until the origin's
   breaker is open in Redis, and until the edge itself answers `503 degraded` (the transition
   recorded by Celery, the next publish, KV's propagation, the edge's second of memory).

It stops everything it started, by pid.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from urllib.parse import urlsplit

import harness

from sigil import redis_keys
from sigil.ports import free_port, free_port_block

AGENT = "bench"
POLL_SECONDS = 0.002
FLAKY = """export default { async fetch(request) {
  if (new URL(request.url).searchParams.has('fail')) return new Response('out of coffee', { status: 500 });
  return new Response('ok');
} }"""
THROWS = "export default { async fetch() { throw new Error('kaput') } }"


class EdgeSigil:
    """One Sigil on `backend` under runsigil, with the edge on, the emulator its Cloudflare."""

    def __init__(self, processes: harness.Processes, backend: str, *, kv_propagation: float) -> None:
        import redis

        self.backend = backend
        self.var_dir = harness.fresh_var_dir(f"edge-{backend}")
        self.redis_url = f"unix://{self.var_dir / 'redis.sock'}"  # runsigil's bundled Redis
        self.port, self.emulator_port = free_port(), free_port()
        env = harness.sigil_environment(
            self.var_dir,
            own_redis=True,
            SIGIL_BACKEND=backend,
            SIGIL_WORKERD_PORT=str(free_port_block()),
            CF_EMULATOR_PORT=str(self.emulator_port),
            SIGIL_ORIGIN_URL=f"http://127.0.0.1:{self.port}",
            SIGIL_EDGE="true",
        )
        for name in ("CF_API_TOKEN", "CF_API_BASE", "CF_ACCOUNT_ID", "SIGIL_CF_WORKERS_BASE", "SIGIL_EDGE_URL"):
            env.pop(name, None)  # the emulator's account, which runsigil starts
        harness.manage("migrate", "--noinput", env=env)
        runsigil = processes.start(
            [sys.executable, "manage.py", "runsigil", "--port", str(self.port)],
            env=env,
            log=self.var_dir / "runsigil.log",
        )
        harness.wait_for_health(self.port, runsigil, seconds=180)
        # Once Redis runs: the tokens are marked for the edge's publisher as they are issued.
        tokens = json.loads(harness.manage("createagent", AGENT, "--json", env={**env, "REDIS_URL": self.redis_url}))
        self.deploy_token, self.invoke = tokens["deploy_token"], harness.bearer(tokens["invoke_token"])
        self.redis = redis.Redis(unix_socket_path=self.redis_url.removeprefix("unix://"))
        emulator = http.client.HTTPConnection("127.0.0.1", self.emulator_port, timeout=30)
        changes = json.dumps({"kv_miss_cache_seconds": 0, "kv_propagation_seconds": kv_propagation})
        headers = {"Content-Type": "application/json"}
        response, body = harness.request(emulator, "POST", "/__emulator/config", headers=headers, body=changes)
        if response.status != 200:
            raise RuntimeError(f"the emulator's config answered {response.status}: {body[:300]!r}")
        emulator.close()
        self.edge_base = ""
        self.edge: http.client.HTTPConnection | None = None

    def deploy(self, name: str, code: str) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {**harness.bearer(self.deploy_token), "Content-Type": "application/json"}
        response, body = harness.request(
            connection, "POST", "/_api/deploy", headers=headers, body=json.dumps({"name": name, "code": code})
        )
        connection.close()
        if response.status not in (200, 201):
            raise RuntimeError(f"deploy of {name} on {self.backend}: {response.status} {body[:300]!r}")
        url = urlsplit(json.loads(body)["url"])  # the edge's: the emulator's workers.dev door
        self.edge_base = url.path.removesuffix(f"/{AGENT}/{name}")
        self.edge = http.client.HTTPConnection(url.hostname, url.port, timeout=60)

    def call(self, path: str) -> tuple[int, dict]:
        response, body = harness.request(self.edge, "GET", f"{self.edge_base}{path}", headers=self.invoke)
        error = json.loads(body)["error"] if response.getheader("Content-Type") == "application/json" else {}
        return response.status, error

    def applied(self) -> int:
        return int(self.redis.hget(redis_keys.EDGE_REPORTS, "applied") or 0)

    def served_at_edge(self, path: str, *, patience: float = 60.0) -> None:
        """Call `path` until a call of it is reported by the edge (not served by the origin)."""
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            before = self.applied()
            self.call(path)
            reported = time.monotonic() + 3
            while time.monotonic() < reported:
                if self.applied() > before:
                    return
                time.sleep(0.05)
        raise RuntimeError(f"the edge did not serve {path} within {patience:g} s on {self.backend}")

    def counted_after(self, path: str, *, patience: float = 30.0) -> float:
        """ms from a call's answer at the edge to its report applied at the origin."""
        before = self.applied()
        self.call(path)
        answered = time.perf_counter()
        while self.applied() <= before:
            if time.perf_counter() - answered > patience:
                raise RuntimeError(f"the report of {path} was not applied within {patience:g} s")
            time.sleep(POLL_SECONDS)
        return (time.perf_counter() - answered) * 1000

    def breaker_round(self, name: str, threshold: int) -> tuple[float, float]:
        """(ms until the origin's breaker is open, s until the edge refuses) after the failure
        that reached `threshold`."""
        full = f"{AGENT}--{name}"
        self.served_at_edge(f"/{AGENT}/{name}")  # its first failure, at the edge
        for _ in range(threshold - 1):
            self.call(f"/{AGENT}/{name}")
        tripped = time.perf_counter()
        opened = None
        while True:
            if opened is None and self.redis.exists(redis_keys.breaker_open(full)):
                opened = (time.perf_counter() - tripped) * 1000
            status, error = self.call(f"/{AGENT}/{name}")
            if status == 503 and error.get("code") == "degraded":
                return opened if opened is not None else float("nan"), time.perf_counter() - tripped
            if time.perf_counter() - tripped > 180:
                raise RuntimeError(f"the edge did not refuse {full} within 180 s")
            time.sleep(0.05)


def figures(values: list[float]) -> str:
    return (
        f"p50 {harness.percentile(values, 0.5):.0f} ms, p99 {harness.percentile(values, 0.99):.0f} ms, "
        f"worst {max(values):.0f} ms"
    )


def main() -> int:
    args = harness.options(
        __doc__,
        calls=40,
        rounds=3,
        kv_propagation=(0.0, "seconds a KV location keeps a read (Cloudflare: up to 60)"),
        backends=("worker-pool,platform,loader", "the runtimes to measure, comma-separated"),
    )
    print(f"load average {harness.load_average()}")
    results = {}
    with harness.Processes() as processes:
        for backend in args.backends.split(","):
            sigil = EdgeSigil(processes, backend, kv_propagation=args.kv_propagation)
            sigil.deploy("flaky", FLAKY)
            for n in range(args.rounds):
                sigil.deploy(f"boom-{n}", THROWS)
            sigil.served_at_edge(f"/{AGENT}/flaky")
            successes, failures = [], []
            for i in range(args.calls):
                if i % 2:
                    failures.append(sigil.counted_after(f"/{AGENT}/flaky?fail=1"))
                else:
                    successes.append(sigil.counted_after(f"/{AGENT}/flaky"))
            rounds = [sigil.breaker_round(f"boom-{n}", threshold=5) for n in range(args.rounds)]
            results[backend] = (successes, failures, rounds)
            print(f"{backend}: measured (var dir {sigil.var_dir})")
    print(f"load average {harness.load_average()}")
    for backend, (successes, failures, rounds) in results.items():
        print(f"{backend}: a success's report applied at the origin after its answer: {figures(successes)}")
        print(f"{backend}: a failure's report applied at the origin after its answer: {figures(failures)}")
        opened = ", ".join(f"{ms:.0f} ms" for ms, _ in rounds)
        refused = ", ".join(f"{seconds:.1f} s" for _, seconds in rounds)
        print(
            f"{backend}: after the failure that trips the breaker, the origin's breaker open: {opened}; "
            f"the edge answering 503 degraded: {refused} (KV propagation {args.kv_propagation:g} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
