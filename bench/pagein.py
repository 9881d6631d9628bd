"""Page-in benchmark on the worker-pool runtime against the local Cloudflare emulator.

    .venv/bin/python bench/pagein.py [--latency 0.05] [--rounds 30]

The emulator answers every API call after `--latency` seconds, as Cloudflare's own round
trip would. Each round evicts a capability and pages it back in (the service the engine's
cold path calls); the overhead is the page-in time less the emulator's latency for the API
calls it made. Also prints how many API calls one page-in costs, from the emulator's log.
"""

from __future__ import annotations

import statistics
import sys
import time

from harness import fresh_var_dir, options, setup_django_here, start_emulator

TARGET_OVERHEAD_MS = 50.0


def main() -> int:
    args = options(__doc__, latency=0.05, rounds=30)

    from sigil.ports import free_port

    var_dir = fresh_var_dir("pagein")
    emulator_port = free_port()
    # No Celery worker here: the deploy answers at once and is placed below.
    embedded = setup_django_here(
        var_dir, SIGIL_BACKEND="worker-pool", CF_EMULATOR_PORT=str(emulator_port), SIGIL_DEPLOY_WAIT_SECONDS="0"
    )
    from agents import services as agent_services
    from agents.tokens import Principal
    from capabilities import services

    emulator = start_emulator(var_dir, port=emulator_port)
    try:
        agent = agent_services.agent_create(name="bench", actor="owner:bench")
        principal = Principal(agent.pk, agent.name, "deploy", "bench")
        code = "export default { async fetch() { return new Response('paged') } }"
        deployed = services.capability_deploy(principal=principal, name="paged", code=code)
        services.capability_place_version(version_id=deployed.version.pk)  # a Celery worker's part
        emulator.api.configure({"latency": args.latency})
        timings, calls = [], []
        for _ in range(args.rounds):
            services.capability_evict(full="bench--paged", actor="owner:bench")
            before = len(emulator.api.request_log())
            started = time.perf_counter()
            services.capability_page_in(full="bench--paged")
            timings.append((time.perf_counter() - started) * 1000)
            calls.append(len(emulator.api.request_log()) - before)
    finally:
        emulator.stop()
        embedded.stop()

    api_calls = statistics.median(calls)
    overheads = sorted(t - api_calls * args.latency * 1000 for t in timings)
    p50 = statistics.median(overheads)
    print(f"emulated Cloudflare latency per API call: {args.latency * 1000:.0f} ms")
    print(f"API calls per page-in: {api_calls:g} (upload + workers.dev toggle)")
    print(f"page-in time p50: {statistics.median(timings):.1f} ms over {args.rounds} rounds")
    print(
        f"page-in overhead beyond the emulator's latency: p50 {p50:.1f} ms, max {overheads[-1]:.1f} ms "
        f"(target <= {TARGET_OVERHEAD_MS:.0f} ms p50)"
    )
    return 0 if p50 <= TARGET_OVERHEAD_MS else 1


if __name__ == "__main__":
    sys.exit(main())
