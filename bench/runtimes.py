"""Warm invoke latency on every runtime, in one run, against the local Cloudflare emulator.

    .venv/bin/python bench/runtimes.py [--rounds 20] [--batch 25]

Four Sigil servers (uvicorn, one worker each) run side by side on one database and
one Redis, one per SIGIL_BACKEND: local (workerd on this machine), worker-pool, platform and
loader (the Cloudflare emulator, its scripts on workerd). Each serves the same capability
code, deployed over the REST API. Calls are interleaved across the four in rounds, so drift
hits them alike; every figure is a median of warm keep-alive calls.

- `via Sigil`: a call to `/{agent}/{capability}` through Sigil's engine;
- `upstream`: the same call sent straight to where the engine sends it (the runtime's
  route: workerd's loader host, a workers.dev URL, the dispatch Worker, the loader Worker);
- `Sigil adds`: via Sigil less upstream, the engine's own cost (token, route, breaker,
  stats in Redis, one more HTTP hop);
- `beyond workerd`: upstream less the same code on bare workerd (the local runtime's
  upstream): what the runtime's path costs here, which on Cloudflare is a different figure.

The emulator's own overhead is measured apart: a pooled script called through the
emulator's workers.dev proxy, less the same script called on the emulator's workerd
directly. The emulated worker-pool and loader paths cross that proxy once, the platform
path twice (the dispatch Worker reaches the namespace through the emulator).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

from harness import ROOT, fresh_var_dir, options, setup_django_here, start_emulator, wait_until, workerd_in_thread

BACKENDS = ("local", "worker-pool", "platform", "loader")
CODE = "export default { async fetch() { return new Response('pong') } }"


def main() -> int:
    args = options(__doc__, rounds=20, batch=25)

    from cfemulator.api import DEV_ACCOUNT_ID, DEV_TOKEN
    from sigil.ports import free_port, free_port_block, port_is_open

    var_dir = fresh_var_dir("runtimes")
    emulator_port, workerd_port = free_port(), free_port_block()
    embedded = setup_django_here(
        var_dir,
        SIGIL_WORKERD_PORT=str(workerd_port),
        CF_API_BASE=f"http://127.0.0.1:{emulator_port}/client/v4",
        CF_API_TOKEN=DEV_TOKEN,
        CF_ACCOUNT_ID=DEV_ACCOUNT_ID,
        SIGIL_CF_WORKERS_BASE=f"http://127.0.0.1:{emulator_port}",
        # No Celery worker here: a Cloudflare deploy answers 202 at once, and this script
        # places it itself (`place_queued`).
        SIGIL_DEPLOY_WAIT_SECONDS="0",
    )
    import urllib3
    from django.conf import settings

    from agents import services as agent_services
    from capabilities.models import Capability
    from capabilities.runtimes import build_runtime
    from testsupport.servers import server_command

    emulator = start_emulator(var_dir, port=emulator_port)
    stop_workerd = workerd_in_thread()  # the local runtime's processes, supervised here
    servers: dict[str, subprocess.Popen] = {}
    ports = {backend: free_port() for backend in BACKENDS}
    http = urllib3.PoolManager(maxsize=4, retries=False, timeout=30)
    try:
        agent = agent_services.agent_create(name="bench", actor="owner:bench")
        _, token = agent_services.token_issue(agent=agent, scope="deploy", actor="owner:bench")
        for backend in BACKENDS:
            servers[backend] = subprocess.Popen(
                server_command("uvicorn", port=ports[backend], workers=1),
                cwd=ROOT,
                env={**os.environ, "SIGIL_BACKEND": backend},
                start_new_session=True,
            )
        wait_until(lambda: all(port_is_open(port) for port in ports.values()), "the Sigil servers did not listen")

        auth = {"Authorization": f"Bearer {token}"}
        targets = {}
        for backend in BACKENDS:
            name = f"ping-{backend}"
            deployed = http.request(
                "POST",
                f"http://127.0.0.1:{ports[backend]}/_api/deploy",
                json={"name": name, "code": CODE},
                headers=auth,
            )
            if deployed.status == 202:
                place_queued(backend, full=f"bench--{name}")
            elif deployed.status != 201:
                raise RuntimeError(f"deploy on {backend}: {deployed.status} {deployed.data[:300]!r}")
            capability = Capability.objects.get(full_name=f"bench--{name}")
            route = build_runtime(backend).route(slot=capability.slot, sha=capability.placed_sha, tenant="bench")
            upstream_headers = dict(route.headers) | ({"Host": route.host_header} if route.host_header else {})
            targets[backend] = {
                "via Sigil": (f"http://127.0.0.1:{ports[backend]}/bench/{name}", auth),
                "upstream": (route.base_url + "/", upstream_headers),
            }
        # The pooled script as the emulator's workerd runs it (behind Sigil's guard), without
        # the emulator's workers.dev proxy in front.
        pool = Capability.objects.get(full_name="bench--ping-worker-pool")
        emulator_direct = (
            emulator.workerd.url + "/",
            {
                "X-Sigil-Secret": emulator.workerd.secret,
                "X-Sigil-Loader-Id": f"{pool.slot}@{emulator.api.scripts[pool.slot].sha}",
                "X-Sigil-Pool-Secret": settings.SIGIL_INTERNAL_SECRET,
            },
        )

        def timed(url: str, headers: dict) -> float:
            started = time.perf_counter()
            response = http.request("GET", url, headers=headers)
            elapsed = (time.perf_counter() - started) * 1000
            if response.status != 200 or response.data != b"pong":
                raise RuntimeError(f"{url}: {response.status} {response.data[:200]!r}")
            return elapsed

        samples: dict[tuple[str, str], list[float]] = {}
        series = [(b, kind, *targets[b][kind]) for b in BACKENDS for kind in ("via Sigil", "upstream")]
        series.append(("emulator", "workerd direct", *emulator_direct))
        for _, _, url, headers in series:  # warm every isolate, connection and cache
            for _ in range(50):
                timed(url, headers)
        for _ in range(args.rounds):
            for backend, kind, url, headers in series:
                samples.setdefault((backend, kind), []).extend(timed(url, headers) for _ in range(args.batch))
    finally:
        for process in servers.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=10)
        emulator.stop()
        stop_workerd()
        embedded.stop()

    median = {key: statistics.median(values) for key, values in samples.items()}
    p90 = {key: statistics.quantiles(values, n=10)[-1] for key, values in samples.items()}
    bare = median[("local", "upstream")]
    count = args.rounds * args.batch
    print(f"warm calls, {count} per figure, medians in ms (p90 in brackets); same code on every runtime")
    print()
    print(f"{'runtime':<12} {'via Sigil':>16} {'upstream':>16} {'Sigil adds':>11} {'beyond workerd':>15}")
    for backend in BACKENDS:
        via, up = median[(backend, "via Sigil")], median[(backend, "upstream")]
        via_p90, up_p90 = p90[(backend, "via Sigil")], p90[(backend, "upstream")]
        print(
            f"{backend:<12} {via:>7.3f} [{via_p90:>6.3f}] {up:>7.3f} [{up_p90:>6.3f}]"
            f" {via - up:>11.3f} {up - bare:>15.3f}"
        )
    direct = median[("emulator", "workerd direct")]
    hop = median[("worker-pool", "upstream")] - direct
    print()
    print(
        f"emulator's own overhead: {hop:.3f} ms per proxied call (pooled script via workers.dev "
        f"{median[('worker-pool', 'upstream')]:.3f} ms, on the emulator's workerd directly {direct:.3f} ms);"
    )
    print("the emulated worker-pool and loader paths cross it once, the platform path twice")
    return 0


def place_queued(backend: str, *, full: str) -> None:
    """Do what a Celery worker on `backend` does with a deploy queued there: place its version."""
    from django.conf import settings

    from capabilities import services
    from capabilities.models import CapabilityVersion
    from capabilities.runtimes import runtimes_forget

    settings.SIGIL_BACKEND = backend
    runtimes_forget()
    version = CapabilityVersion.objects.filter(capability__full_name=full).order_by("-number").first()
    outcome = services.capability_place_version(version_id=version.pk)
    if outcome["status"] != "placed":
        raise RuntimeError(f"deploy on {backend}: {outcome}")


if __name__ == "__main__":
    sys.exit(main())
