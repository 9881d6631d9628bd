"""Edge budget benchmark: steady traffic at the edge, then a deploy and a page-in, on the emulator.

    .venv/bin/python bench/edge_budget.py [--minutes 10] [--rate 10] [--port 0] [--runs 3]

Sigil starts as its owner starts it (`make -o install run`, SIGIL_BACKEND=worker-pool, the
runtime with a pager, no CF_API_TOKEN: the emulator, the edge on, call records on, beat doing
its housekeeping) in a fresh temporary var directory, on 127.0.0.1 only (bench/edge.py's
EdgeSigil). Before the traffic, `--runs` deploys of fresh capabilities and `--runs` page-ins
are timed: the owner evicts a capability (the admin's evict), and once its page-out is done
and published, a caller calls it at the edge, which hands it to the origin to page in. Then a
caller calls two capabilities in turn through the edge, `--rate` calls a second for
`--minutes`, over one kept-alive connection; then the same deploys and page-ins again. It
prints the answers by status, their p50 and p99, the Cloudflare API requests made meanwhile
(as Sigil counted them, and the emulator's log of them by endpoint: beat's housekeeping, not
the calls, should be all there is) and the deploys' and page-ins' times before and after.

It stops everything it started, by its process group.
"""

from __future__ import annotations

import http.client
import json
import re
import statistics
import sys
import time
from collections import Counter
from urllib.parse import urlsplit

import harness
from edge import AGENT, EdgeSigil

from sigil import redis_keys
from sigil.ports import free_port_block

TRAFFIC = ("hello", "other")
ANSWERS = "export default {{ async fetch() {{ return new Response('{}') }} }}"
EVICT = """
import time
from capabilities import services
from capabilities.models import Capability
full = "{full}"
services.capability_evict(full=full, actor="owner:bench")
deadline = time.monotonic() + 120
while Capability.objects.get(full_name=full).state != "paged_out" and time.monotonic() < deadline:
    time.sleep(0.05)
print(Capability.objects.get(full_name=full).state)
"""
PUBLISHED_AFTER = 5.0  # s: beat publishes every 3 s (SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS), the edge remembers 1 s
# An id in an API path (an account's, a namespace's, a script's name), for grouping the log by endpoint.
ID = re.compile(r"/(?:[0-9a-f]{32}|s-[0-9a-z-]+|sigil[-a-z]*|bench--[a-z0-9-]+)(?=/|$)")


class Caller(harness.Loops):
    """Calls the capabilities in turn at the edge, `rate` a second, on one kept-alive connection."""

    join_seconds = 60.0

    def __init__(self, urls: list[str], headers: dict[str, str], *, rate: float) -> None:
        self.urls, self.headers, self.rate = [urlsplit(url) for url in urls], headers, rate
        self.statuses: Counter = Counter()
        self.times: list[float] = []
        self.set_loops(self.run)

    def run(self) -> None:
        connection = None
        started = time.monotonic()
        n = 0
        while self.running.is_set():
            url = self.urls[n % len(self.urls)]
            sent = time.perf_counter()
            try:
                if connection is None:
                    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
                response, _ = harness.request(connection, "GET", url.path, headers=self.headers)
                status = response.status
            except (OSError, http.client.HTTPException):
                connection.close()
                connection, status = None, 0
            self.statuses[status] += 1
            self.times.append((time.perf_counter() - sent) * 1000)
            n += 1
            time.sleep(max(0.0, started + n / self.rate - time.monotonic()))


def timed_control_plane(sigil: EdgeSigil, *, runs: int, tag: str) -> tuple[list[float], list[float]]:
    """(ms of `runs` deploys of fresh capabilities, ms of `runs` page-ins at the edge's call)."""
    deploys, page_ins = [], []
    for n in range(runs):
        name = f"{tag}-{n}"
        took, url = sigil.deploy(name, ANSWERS.format(name), type="normal")
        deploys.append(took)
        state = harness.manage("shell", "-c", EVICT.format(full=f"{AGENT}--{name}"), env=sigil.env).strip()
        if not state.endswith("paged_out"):
            raise RuntimeError(f"{name} was not paged out: {state}")
        time.sleep(PUBLISHED_AFTER)
        where = urlsplit(url)
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
        started = time.perf_counter()
        response, body = harness.request(connection, "GET", where.path, headers=sigil.invoke)
        page_ins.append((time.perf_counter() - started) * 1000)
        connection.close()
        if response.status != 200 or body.decode() != name or response.getheader("X-Sigil-Cold-Start") != "1":
            raise RuntimeError(f"the page-in of {name} answered {response.status}: {body[:200]!r}")
    return deploys, page_ins


def endpoint(path: str) -> str:
    return ID.sub("/{id}", path.removeprefix("/client/v4"))


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.0f} ms ({min(values):.0f}-{max(values):.0f})"


def main() -> int:
    args = harness.options(
        __doc__,
        minutes=10.0,
        rate=(10.0, "calls a second through the edge"),
        port=(0, "the web server's PORT (the emulator's and workerd's follow from it); 0: a free one"),
        runs=(3, "deploys and page-ins timed before and after the traffic"),
    )
    print(f"load average {harness.load_average()}")
    with harness.Processes() as processes:
        sigil = EdgeSigil(processes, "worker-pool", port=args.port or free_port_block(), records=True)
        print(f"worker-pool: var dir {sigil.var_dir}")
        _, other = sigil.deploy("other", ANSWERS.format("other"))
        sigil.wait_for_the_edge()
        sigil.wait_for_the_edge(other)
        before = timed_control_plane(sigil, runs=args.runs, tag="before")

        api_calls = int(sigil.redis.get(redis_keys.CF_CALLS) or 0)
        rate_limited = int(sigil.redis.get(redis_keys.CF_RATE_LIMITED) or 0)
        started = time.time()
        with Caller([sigil.edge_url, other], sigil.invoke, rate=args.rate) as caller:
            time.sleep(args.minutes * 60)
        ended = time.time()
        spent = int(sigil.redis.get(redis_keys.CF_CALLS) or 0) - api_calls
        refused = int(sigil.redis.get(redis_keys.CF_RATE_LIMITED) or 0) - rate_limited
        emulator = http.client.HTTPConnection(urlsplit(sigil.emulator).hostname, urlsplit(sigil.emulator).port)
        _, body = harness.request(emulator, "GET", "/__emulator/requests")
        emulator.close()
        logged = [entry for entry in json.loads(body)["requests"] if started <= entry["time"] <= ended]
        by_endpoint = Counter(f"{entry['method']} {endpoint(entry['path'])}" for entry in logged)

        after = timed_control_plane(sigil, runs=args.runs, tag="after")
        sigil.owner.ctrl_c()

    calls = sum(caller.statuses.values())
    print(f"load average {harness.load_average()}")
    print(
        f"{calls} calls at the edge over {args.minutes:g} min ({calls / (args.minutes * 60):.1f}/s), by status: "
        f"{dict(sorted(caller.statuses.items()))}; p50 {harness.percentile(caller.times, 0.5):.1f} ms, "
        f"p99 {harness.percentile(caller.times, 0.99):.1f} ms"
    )
    print(
        f"Cloudflare API requests meanwhile: {spent} counted by Sigil ({spent / (args.minutes * 60):.2f}/s, "
        f"{refused} refused 429); the emulator's log, by endpoint:"
    )
    for name, count in by_endpoint.most_common():
        print(f"  {count:5}  {name}")
    for label, (deploys, page_ins) in (("before", before), ("after", after)):
        print(f"{label} the traffic: deploy {spread(deploys)}, page-in at the edge's call {spread(page_ins)}")
    return 0 if set(caller.statuses) == {200} else 1


if __name__ == "__main__":
    sys.exit(main())
