"""Storm benchmark: one agent's slow calls beside another agent's warm calls, and what a call in
flight costs the server.

    .venv/bin/python bench/storm.py [--storm 1000] [--wait-seconds 5] [--quiet-calls 2000]

It starts Sigil as `make run` does (the bundled Redis or REDIS_URL, runworkerd, a migrated
SQLite database under a fresh var directory, granian with one ASGI worker on uvloop), creates agents
`storm` and `quiet`, and deploys `storm--slow` (awaits --wait-seconds, then answers: no CPU)
and `quiet--ping`. Then, each time with `quiet`'s warm calls made one after another over one
keep-alive connection, timed per call:

1. quiet alone;
2. beside `--storm` concurrent calls of `storm` to its slow capability, with storm's cap on
   calls in flight raised above the storm (the owner's override, `agent_set_shares`);
3. the same storm with the default caps (SIGIL_AGENT_CALLS_IN_FLIGHT): storm's calls over its
   share are `429`, and quiet notices nothing.

Then the burst, where the storm's arrival itself is measured: a separate client process opens
`--storm` connections first and then sends the slow call on all of them at once (default caps:
most are `429`), while quiet calls on a fixed schedule (one every `--quiet-interval-ms`), each
call's time counted from when it was due, so that calls held up behind the burst count in full
(no coordinated omission). Quiet's p99 over `--burst-window` seconds from the burst's send,
against the same schedule alone just before; the CPU time of each process meanwhile is printed,
the load's own (the burst client, quiet's caller) with the servers', since they share the
machine's cores. The same burst and schedule are also sent to a bare ASGI app that does no
work (bench/bare_asgi.py) under the same granian command: what the burst adds to its quiet p99
is the server's own floor, and Sigil's own share is what it adds to Sigil's less that floor.
`--bursts` rounds, each the bare app's burst then Sigil's.

It prints quiet's p50/p99/max and failures in each phase, the storm's outcomes by status, and
the web worker's resident memory idle and with the storm in flight, per call in flight. It
stops everything it started, by pid.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp
from bare_asgi import BARE_APPLICATION
from harness import Processes, deploy, fresh_var_dir, load_average, manage, options, sigil_environment, wait_for_health

from capabilities.workerd.supervision import process_cpu_ms
from sigil.ports import free_port, free_port_block
from testsupport.servers import server_command

SLOW = "export default { async fetch() { await new Promise(r => setTimeout(r, %d)); return new Response('slow') } }"
PING = "export default { async fetch() { return new Response('pong') } }"


def tree_pids(pid: int) -> list[int]:
    """`pid` and its descendants (a server's workers, runworkerd's workerd processes)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid, *(descendant for child in children for descendant in tree_pids(int(child)))]


def cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """CPU time used so far by each named process tree."""
    return {name: sum(process_cpu_ms(p) or 0 for p in tree_pids(pid)) / 1000 for name, pid in roots.items()}


def rss_kb(pid: int) -> int:
    """Resident memory of a process and its children (granian's worker is a child)."""
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total += int(line.split()[1])
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return total + sum(rss_kb(int(child)) for child in children)


def quiet_calls(port: int, token: str, count: int) -> tuple[list[float], int]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {token}"}
    times, failed = [], 0
    for _ in range(count):
        started = time.perf_counter()
        connection.request("GET", "/quiet/ping", headers=headers)
        response = connection.getresponse()
        body = response.read()
        times.append((time.perf_counter() - started) * 1000)
        if response.status != 200 or body != b"pong":
            failed += 1
    connection.close()
    return times, failed


def storm_call(port: int, token: str) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/storm/slow", headers={"Authorization": f"Bearer {token}"})
    connection.getresponse().read()
    connection.close()


async def storm(port: int, token: str, count: int) -> Counter:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one():
            try:
                async with session.get(
                    f"http://127.0.0.1:{port}/storm/slow", headers={"Authorization": f"Bearer {token}"}
                ) as response:
                    await response.read()
                    return response.status
            except aiohttp.ClientError as exc:
                return type(exc).__name__

        return Counter(await asyncio.gather(*(one() for _ in range(count))))


def burst_connections(port: int, token: str, count: int) -> dict:
    """The burst client's work: `count` connections opened first, then the slow call sent on
    every one at once (after "go" on stdin); the answers by status, the time to the last and the
    client's CPU time from the send. Plain sockets and one selector, so that the client itself
    takes little of the CPU."""
    request = (
        f"GET /storm/slow HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    ).encode()
    connections = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    print("connected", flush=True)
    sys.stdin.readline()
    sent, cpu_at_send = time.perf_counter(), time.process_time()
    for connection in connections:
        connection.sendall(request)
    answers: dict[socket.socket, bytearray] = {}
    with selectors.DefaultSelector() as selector:
        for connection in connections:
            connection.setblocking(False)
            answers[connection] = bytearray()
            selector.register(connection, selectors.EVENT_READ)
        while selector.get_map():
            for key, _ in selector.select():
                try:
                    data = key.fileobj.recv(65536)
                except OSError:
                    data = b""
                if data:
                    answers[key.fileobj] += data
                else:
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
    last = time.perf_counter() - sent
    statuses = Counter(bytes(answer).split(b" ", 2)[1].decode() if answer else "closed" for answer in answers.values())
    return {"statuses": dict(statuses), "last_answer_s": last, "cpu_s": time.process_time() - cpu_at_send}


def burst_client_main(port: int, token: str, count: int) -> None:
    print(json.dumps(burst_connections(port, token, count)), flush=True)


def scheduled_quiet_calls(port: int, token: str, *, interval_ms: float, seconds: float) -> tuple[list[float], int]:
    """Quiet's calls due every `interval_ms` for `seconds`, one after another over one
    keep-alive connection; each one's time from when it was due to its answer."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {token}"}
    times, failed = [], 0
    started = time.perf_counter()
    due = started
    while due < started + seconds:
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        connection.request("GET", "/quiet/ping", headers=headers)
        response = connection.getresponse()
        body = response.read()
        times.append((time.perf_counter() - due) * 1000)
        if response.status != 200 or body != b"pong":
            failed += 1
        due += interval_ms / 1000
    connection.close()
    return times, failed


def summary(times: list[float], failed: int) -> dict:
    return {
        "p50": statistics.median(times),
        "p99": sorted(times)[int(0.99 * len(times))],
        "max": max(times),
        "failed": failed,
        "calls": len(times),
    }


def burst_phase(port: int, tokens: dict, args, *, servers: dict[str, int]) -> dict:
    """Quiet on its schedule alone, then on the same schedule from the moment a burst of
    `args.storm` connections sends at once; the CPU each of `servers` used in each window, and
    the load's own beside the burst (the burst client's from its send, quiet's caller's)."""
    cpu_before = cpu_seconds(servers)
    alone = summary(
        *scheduled_quiet_calls(port, tokens["quiet"], interval_ms=args.quiet_interval_ms, seconds=args.burst_window)
    )
    cpu_alone = {name: used - cpu_before[name] for name, used in cpu_seconds(servers).items()}
    client = subprocess.Popen(
        [sys.executable, __file__, "--burst-client", str(port), tokens["storm"], str(args.storm)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    if client.stdout.readline().strip() != "connected":
        raise RuntimeError("the burst client did not connect")
    beside: dict = {}

    def quiet() -> None:
        times, failed = scheduled_quiet_calls(
            port, tokens["quiet"], interval_ms=args.quiet_interval_ms, seconds=args.burst_window
        )
        beside.update(summary(times, failed), cpu_s=time.thread_time())  # the thread did only this

    quiet_thread = threading.Thread(target=quiet)
    cpu_before = cpu_seconds(servers)
    quiet_thread.start()
    client.stdin.write("go\n")
    client.stdin.flush()
    outcome = json.loads(client.stdout.readline())
    client.wait()
    quiet_thread.join()
    cpu = {name: used - cpu_before[name] for name, used in cpu_seconds(servers).items()}
    cpu["burst client"] = outcome.pop("cpu_s")
    cpu["quiet's caller"] = beside.pop("cpu_s")
    return {"alone": alone, "beside": beside, "burst": outcome, "cpu": cpu, "cpu_alone": cpu_alone}


def phase(port, tokens, args, *, storm_size: int, web_pid: int) -> dict:
    """Quiet's calls, beside a storm of `storm_size` (0: none) started just before them."""
    outcome: dict = {}
    loop = asyncio.new_event_loop()
    storming = None
    if storm_size:
        storming = loop.run_in_executor(None, lambda: asyncio.run(storm(port, tokens["storm"], storm_size)))
        time.sleep(min(2.0, args.wait_seconds / 2))  # the storm in flight
        outcome["rss_storm_kb"] = rss_kb(web_pid)
    times, failed = quiet_calls(port, tokens["quiet"], args.quiet_calls)
    outcome.update(
        p50=statistics.median(times),
        p99=sorted(times)[int(0.99 * len(times))],
        max=max(times),
        failed=failed,
        calls=len(times),
    )
    if storming is not None:
        outcome["storm"] = loop.run_until_complete(storming)
    loop.close()
    return outcome


def storm_phases(port: int, tokens: dict, args, *, web_pid: int, env: dict) -> tuple:
    """Quiet alone, beside the storm with its cap raised, and beside it with the default caps;
    and the web worker's memory idle."""
    rss_idle = rss_kb(web_pid)
    alone = phase(port, tokens, args, storm_size=0, web_pid=web_pid)
    set_storm_share(args.storm * 2, env=env)
    raised = phase(port, tokens, args, storm_size=args.storm, web_pid=web_pid)
    set_storm_share(None, env=env)
    capped = phase(port, tokens, args, storm_size=args.storm, web_pid=web_pid)
    return rss_idle, alone, raised, capped


def set_storm_share(calls_in_flight: int | None, *, env: dict) -> None:
    """The owner's override of storm's cap on calls in flight (None: the default)."""
    manage(
        "shell",
        "-c",
        "from agents.models import Agent; from agents.services import agent_set_shares; "
        f"agent_set_shares(agent=Agent.objects.get(name='storm'), calls_in_flight={calls_in_flight}, "
        "placements_in_flight=None, actor='bench')",
        env=env,
    )


def print_storm_phases(args, rss_idle: int, alone: dict, raised: dict, capped: dict) -> None:
    print()
    print(f"quiet's warm calls ({args.quiet_calls} per phase, one after another), ms:")
    print(f"{'phase':44} {'p50':>7} {'p99':>7} {'max':>8} {'failed':>7}")
    for label, result in (
        ("alone", alone),
        (f"beside {args.storm} slow calls, storm's cap raised", raised),
        (f"beside {args.storm} slow calls, default caps", capped),
    ):
        print(f"{label:44} {result['p50']:7.2f} {result['p99']:7.2f} {result['max']:8.2f} {result['failed']:7d}")
    print()
    for label, result in (("cap raised", raised), ("default caps", capped)):
        print(f"storm's calls, {label}: {dict(sorted(result['storm'].items(), key=str))}")
    print()
    per_call = (raised["rss_storm_kb"] - rss_idle) / args.storm
    print(
        f"web worker resident memory: {rss_idle / 1024:.1f} MB idle, {raised['rss_storm_kb'] / 1024:.1f} MB with "
        f"{args.storm} calls in flight: {per_call:.1f} KB per call in flight"
    )
    print(f"quiet's p99 beside the raised storm minus alone: {raised['p99'] - alone['p99']:.2f} ms (target <= 10)")


def added_p99(burst: dict) -> float:
    """What the burst added to quiet's p99: from the burst's send, less alone just before."""
    return burst["beside"]["p99"] - burst["alone"]["p99"]


def burst_web_cpu(burst: dict) -> float:
    """The web process's CPU time beside the burst less its time in the window alone (the same
    quiet calls): what the burst itself cost it."""
    return burst["cpu"]["web"] - burst["cpu_alone"]["web"]


def print_burst(args, rounds: list[dict]) -> None:
    print()
    print(
        f"the burst: {args.storm} connections sending at once (Sigil: default caps; the bare app answers every "
        f"one 200), quiet due every {args.quiet_interval_ms:g} ms for {args.burst_window:g} s, ms from when each "
        "call was due:"
    )
    print(f"{'':44} {'p50':>7} {'p99':>7} {'max':>8} {'failed':>7}")
    for number, bursts in enumerate(rounds, 1):
        for server, burst in (("the bare app", bursts["bare"]), ("Sigil", bursts["sigil"])):
            for label, result in (("alone", burst["alone"]), ("from the burst's send", burst["beside"])):
                label = f"{number}. {server}, {label}"
                print(
                    f"{label:44} {result['p50']:7.2f} {result['p99']:7.2f} {result['max']:8.2f} {result['failed']:7d}"
                )
            print(
                f"   burst's answers: {dict(sorted(burst['burst']['statuses'].items()))}, the last after "
                f"{burst['burst']['last_answer_s']:.2f} s; CPU beside the burst: "
                + ", ".join(f"{name} {used:.2f} s" for name, used in burst["cpu"].items())
                + f"; the web process's alone: {burst['cpu_alone']['web']:.2f} s"
            )
    print()
    for number, bursts in enumerate(rounds, 1):
        sigil, floor = added_p99(bursts["sigil"]), added_p99(bursts["bare"])
        print(
            f"{number}. the server's own floor: quiet p99 {floor:+.2f} ms beside the burst; through Sigil "
            f"{sigil:+.2f} ms; Sigil's own share {sigil - floor:+.2f} ms (target <= 10); the burst's own CPU in "
            f"the web process (beside minus alone): the bare app's {burst_web_cpu(bursts['bare']) * 1000:.0f} ms, "
            f"Sigil's {burst_web_cpu(bursts['sigil']) * 1000:.0f} ms"
        )


def main() -> int:
    if sys.argv[1:2] == ["--burst-client"]:
        port, token, count = sys.argv[2:5]
        burst_client_main(int(port), token, int(count))
        return 0
    args = options(
        __doc__,
        storm=1000,
        wait_seconds=5.0,
        quiet_calls=2000,
        quiet_interval_ms=4.0,
        burst_window=3.0,
        only_burst=0,
        bursts=(1, "rounds of the burst, each the bare app's then Sigil's"),
    )

    var_dir = fresh_var_dir("storm")
    env = sigil_environment(var_dir, SIGIL_WORKERD_PORT=str(free_port_block()))
    print(f"var dir {var_dir}; load average {load_average()}")
    with Processes() as processes:
        redis_pid = processes.redis_unless_given(env, var_dir)
        workerd = processes.workerd(env, var_dir)
        manage("migrate", "--noinput", env=env)
        agents = {name: json.loads(manage("createagent", name, "--json", env=env)) for name in ("storm", "quiet")}
        tokens = {name: agent["invoke_token"] for name, agent in agents.items()}
        port = free_port()
        web = processes.start(server_command("granian", port=port, workers=1), env=env, log=var_dir / "granian.log")
        bare_port = free_port()
        bare = processes.start(
            server_command("granian", port=bare_port, workers=1, application=BARE_APPLICATION),
            env=env,
            log=var_dir / "granian-bare.log",
        )
        wait_for_health(port, web)
        wait_for_health(bare_port, bare)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        deploy(connection, agents["storm"]["deploy_token"], "slow", SLOW % int(args.wait_seconds * 1000))
        deploy(connection, agents["quiet"]["deploy_token"], "ping", PING)
        connection.close()
        quiet_calls(port, tokens["quiet"], 200)  # warm every connection and cache
        warm_storm = threading.Thread(target=storm_call, args=(port, tokens["storm"]))
        warm_storm.start()  # storm's token cached, as after its first call

        print(f"web server pid {web.pid}", flush=True)
        if not args.only_burst:
            storms = storm_phases(port, tokens, args, web_pid=web.pid, env=env)
        time.sleep(args.wait_seconds + 1)  # the last storm's calls all ended
        warm_storm.join()
        servers = {"web": web.pid, "workerd": workerd.pid, **({"redis": redis_pid} if redis_pid else {})}
        rounds = [
            {
                "bare": burst_phase(bare_port, tokens, args, servers={"web": bare.pid}),
                "sigil": burst_phase(port, tokens, args, servers=servers),
            }
            for _ in range(args.bursts)
        ]

    if not args.only_burst:
        print_storm_phases(args, *storms)
    print_burst(args, rounds)
    print(f"load average {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
