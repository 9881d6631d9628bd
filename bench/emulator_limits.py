"""A runaway script on the Cloudflare emulator: how fast it is stopped, and what its neighbours see.

    .venv/bin/python bench/emulator_limits.py [--calls 400] [--runaways 10] [--cpu-ms 100]

The emulator runs on free loopback ports with its own workerd processes. A steady script is
called over keep-alive connections; first alone (normal), then while a runaway script
(`while (true) {}`, with `limits.cpu_ms`) is called again and again in another thread
(incident). Printed: the steady calls' p50/p99 in both phases, how long each runaway call
took to end in Cloudflare's error 1102, and how long after each the runaway's fresh process
answered again.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time

from harness import options, start_emulator

STEADY = "export default { async fetch() { return new Response('pong') } }"
RUNAWAY = """export default { async fetch(request) {
  if (new URL(request.url).pathname === "/spin") { while (true) {} }
  return new Response("back");
} }"""


def main() -> int:
    args = options(__doc__, calls=400, runaways=10, cpu_ms=100)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sigil_site.settings")
    os.environ.setdefault("SECRET_KEY", "bench")
    os.environ["SIGIL_VAR_DIR"] = tempfile.mkdtemp(prefix="sigil-bench-emulator-")
    import django

    django.setup()
    import urllib3
    from django.conf import settings

    from cfemulator.api import DEV_ACCOUNT_ID, DEV_TOKEN, EmulatorConfig
    from sigil.ports import free_port

    emulator = start_emulator(settings.VAR_DIR, port=free_port())
    http = urllib3.PoolManager(maxsize=4, timeout=urllib3.Timeout(connect=5.0, read=60.0), retries=False)
    api = f"{emulator.api_base}/accounts/{DEV_ACCOUNT_ID}/workers/scripts"
    auth = {"Authorization": f"Bearer {DEV_TOKEN}"}

    def deploy(name: str, code: str, limits: dict | None = None) -> str:
        metadata = {"main_module": "w.js", "compatibility_date": "2025-01-01", **({"limits": limits} if limits else {})}
        boundary = secrets.token_hex(8)
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="metadata"\r\n\r\n{json.dumps(metadata)}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="w.js"; filename="w.js"\r\n'
            f"Content-Type: application/javascript+module\r\n\r\n{code}\r\n--{boundary}--\r\n"
        ).encode()
        headers = {**auth, "Content-Type": f"multipart/form-data; boundary={boundary}"}
        for response in (
            http.request("PUT", f"{api}/{name}", body=body, headers=headers),
            http.request("POST", f"{api}/{name}/subdomain", body=b'{"enabled":true}', headers=auth),
        ):
            if response.status != 200:
                raise RuntimeError(f"{name}: {response.status} {response.data[:300]!r}")
        return f"{name}.{EmulatorConfig().subdomain}.workers.dev"

    def call(host: str, path: str = "/") -> tuple[int, float]:
        started = time.perf_counter()
        response = http.request("GET", emulator.url + path, headers={"Host": host})
        return response.status, (time.perf_counter() - started) * 1000

    try:
        steady = deploy("steady", STEADY)
        runaway = deploy("runaway", RUNAWAY, {"cpu_ms": args.cpu_ms})
        for _ in range(50):  # warm both processes, their isolates and the connections
            call(steady)
            call(runaway)
        normal = [call(steady)[1] for _ in range(args.calls)]

        stopped_ms: list[float] = []
        back_ms: list[float] = []
        statuses: set[int] = set()
        done = threading.Event()

        def run_away() -> None:
            for _ in range(args.runaways):
                status, took = call(runaway, "/spin")
                statuses.add(status)
                stopped_ms.append(took)
                started = time.perf_counter()
                while call(runaway)[0] != 200:
                    time.sleep(0.01)
                back_ms.append((time.perf_counter() - started) * 1000)
            done.set()

        thread = threading.Thread(target=run_away)
        thread.start()
        incident: list[float] = []
        failed = 0
        while not done.is_set() or len(incident) < args.calls:
            status, took = call(steady)
            failed += status != 200
            incident.append(took)
        thread.join()
    finally:
        emulator.stop()

    def p(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1]

    print(
        f"steady script, ms: normal p50 {p(normal, 50):.2f} p99 {p(normal, 99):.2f} ({len(normal)} calls); "
        f"during the incident p50 {p(incident, 50):.2f} p99 {p(incident, 99):.2f} "
        f"({len(incident)} calls, {failed} failed)"
    )
    print(
        f"runaway script (cpu_ms {args.cpu_ms}), {args.runaways} calls answered {sorted(statuses)}: "
        f"stopped after median {statistics.median(stopped_ms):.0f} ms (max {max(stopped_ms):.0f}); "
        f"its fresh process answered median {statistics.median(back_ms):.0f} ms later (max {max(back_ms):.0f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
