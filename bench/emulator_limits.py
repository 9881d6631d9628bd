"""A runaway script or Dynamic Worker on the Cloudflare emulator: how fast it is stopped, and
what its neighbours see.

    .venv/bin/python bench/emulator_limits.py [--calls 400] [--runaways 10] [--cpu-ms 100] [--fresh-ids 20]

The emulator runs on free loopback ports with its own workerd processes.

Scripts: a steady script is called over keep-alive connections; first alone (normal), then
while a runaway script (`while (true) {}`, with `limits.cpu_ms`) is called again and again in
another thread (incident). Printed: the steady calls' p50/p99 in both phases, how long each
runaway call took to end in Cloudflare's error 1102, and how long after each the runaway's
fresh process answered again.

Dynamic Workers: one Worker with a Worker Loader binding runs two Dynamic Workers by id, a
steady one and a runaway one (`while (true) {}`, `getEntrypoint(null, {limits: {cpuMs}})`),
as the loader runtime runs two agents' capabilities. The steady one is called alone, then
while the runaway is called again and again, each time with a GET and a POST with a body.
Printed: the steady calls' p50/p99/max in both phases and how many failed (a 1102 included),
what the runaway's calls answered and how long they took, and the first call of each of
`--fresh-ids` new ids (a Dynamic Worker not loaded yet), half a second apart and back to
back, against a warm call.
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
# Runs the Dynamic Worker named by the path's first segment: `runaway` spins, any other
# answers with the length of the body it was sent.
LOADS = """export default { async fetch(request, env) {
  const id = new URL(request.url).pathname.split("/")[1];
  const code = id === "runaway"
    ? "export default { async fetch() { while (true) {} } }"
    : "export default { async fetch(request) { return new Response('pong ' + (await request.text()).length) } }";
  const worker = env.LOADER.get(id, async () => ({
    compatibilityDate: "2025-01-01", mainModule: "m.js", modules: { "m.js": code },
  }));
  try {
    return await worker.getEntrypoint(null, { limits: { cpuMs: Number(env.CPU_MS) } }).fetch(request);
  } catch (error) {
    return new Response(String(error.message), { status: 599 });
  }
} }"""


def main() -> int:
    args = options(__doc__, calls=400, runaways=10, cpu_ms=100, fresh_ids=20)

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

    def deploy(name: str, code: str, limits: dict | None = None, bindings: list | None = None) -> str:
        metadata = {"main_module": "w.js", "compatibility_date": "2025-01-01", "bindings": bindings or []}
        if limits:
            metadata["limits"] = limits
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

    def call(host: str, path: str = "/", body: bytes | None = None) -> tuple[int, float, bytes]:
        started = time.perf_counter()
        response = http.request("POST" if body else "GET", emulator.url + path, headers={"Host": host}, body=body)
        return response.status, (time.perf_counter() - started) * 1000, response.data

    try:
        scripts(args, deploy, call)
        dynamic_workers(args, deploy, call)
    finally:
        emulator.stop()
    return 0


def p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def scripts(args, deploy, call) -> None:
    """A runaway script beside a steady one."""
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
            status, took, _ = call(runaway, "/spin")
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
        status, took, _ = call(steady)
        failed += status != 200
        incident.append(took)
    thread.join()

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


def dynamic_workers(args, deploy, call) -> None:
    """A runaway Dynamic Worker beside a steady one of the same loader Worker."""
    bindings = [
        {"type": "worker_loader", "name": "LOADER"},
        {"type": "plain_text", "name": "CPU_MS", "text": str(args.cpu_ms)},
    ]
    loads = deploy("loads", LOADS, bindings=bindings)
    body = b"x" * 1024
    for _ in range(50):
        call(loads, "/steady/")
    normal = [call(loads, "/steady/", body if n % 2 else None)[1] for n in range(args.calls)]

    runaway: list[tuple[int, float, bytes]] = []
    done = threading.Event()

    def run_away() -> None:
        for _ in range(args.runaways):
            runaway.append(call(loads, "/runaway/"))
        done.set()

    thread = threading.Thread(target=run_away)
    thread.start()
    incident: list[float] = []
    failed: dict[int, int] = {}
    n = 0
    while not done.is_set() or len(incident) < args.calls:
        n += 1
        sent = body if n % 2 else None
        status, took, data = call(loads, "/steady/", sent)
        if (status, data) != (200, b"pong %d" % len(sent or b"")):
            failed[status] = failed.get(status, 0) + 1
        incident.append(took)
    thread.join()

    def first_calls(pause: float) -> list[float]:
        took = []
        for _ in range(args.fresh_ids):
            time.sleep(pause)
            took.append(call(loads, f"/fresh-{secrets.token_hex(4)}/")[1])
        return took

    spaced = first_calls(0.5)  # time for whatever the emulator prepares between new ids
    back_to_back = first_calls(0)
    warm = [call(loads, "/steady/")[1] for _ in range(args.fresh_ids)]
    answers = sorted({(status, data.decode(errors="replace")[:60]) for status, _, data in runaway})
    stopped = [took for _, took, _ in runaway]
    print(
        f"steady Dynamic Worker, ms: normal p50 {p(normal, 50):.2f} p99 {p(normal, 99):.2f} "
        f"max {max(normal):.0f} ({len(normal)} calls, half with a body); during the incident "
        f"p50 {p(incident, 50):.2f} p99 {p(incident, 99):.2f} max {max(incident):.0f} "
        f"({len(incident)} calls, failed by status: {failed or 'none'})"
    )
    print(
        f"runaway Dynamic Worker (cpuMs {args.cpu_ms}), {args.runaways} calls answered {answers}: "
        f"after median {statistics.median(stopped):.0f} ms (max {max(stopped):.0f})"
    )
    print(
        f"first call of a new Dynamic Worker id, ms: 0.5 s apart median {statistics.median(spaced):.1f} "
        f"max {max(spaced):.0f}; back to back median {statistics.median(back_to_back):.1f} "
        f"max {max(back_to_back):.0f} ({args.fresh_ids} ids each); a warm call median {statistics.median(warm):.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
