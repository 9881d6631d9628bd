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

It prints quiet's p50/p99/max and failures in each phase, the storm's outcomes by status, and
the web worker's resident memory idle and with the storm in flight, per call in flight. It
stops everything it started, by pid.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
from harness import Processes, deploy, fresh_var_dir, load_average, manage, options, sigil_environment, wait_for_health

from sigil.ports import free_port, free_port_block
from testsupport.servers import server_command

SLOW = "export default { async fetch() { await new Promise(r => setTimeout(r, %d)); return new Response('slow') } }"
PING = "export default { async fetch() { return new Response('pong') } }"


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


def main() -> int:
    args = options(__doc__, storm=1000, wait_seconds=5.0, quiet_calls=2000)

    var_dir = fresh_var_dir("storm")
    env = sigil_environment(var_dir, SIGIL_WORKERD_PORT=str(free_port_block()))
    print(f"var dir {var_dir}; load average {load_average()}")
    with Processes() as processes:
        processes.redis_unless_given(env, var_dir)
        processes.workerd(env, var_dir)
        manage("migrate", "--noinput", env=env)
        agents = {name: json.loads(manage("createagent", name, "--json", env=env)) for name in ("storm", "quiet")}
        tokens = {name: agent["invoke_token"] for name, agent in agents.items()}
        port = free_port()
        web = processes.start(server_command("granian", port=port, workers=1), env=env, log=var_dir / "granian.log")
        wait_for_health(port, web)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        deploy(connection, agents["storm"]["deploy_token"], "slow", SLOW % int(args.wait_seconds * 1000))
        deploy(connection, agents["quiet"]["deploy_token"], "ping", PING)
        connection.close()
        quiet_calls(port, tokens["quiet"], 200)  # warm every connection and cache

        rss_idle = rss_kb(web.pid)
        alone = phase(port, tokens, args, storm_size=0, web_pid=web.pid)
        manage(
            "shell",
            "-c",
            "from agents.models import Agent; from agents.services import agent_set_shares; "
            f"agent_set_shares(agent=Agent.objects.get(name='storm'), calls_in_flight={args.storm * 2}, "
            "placements_in_flight=None, actor='bench')",
            env=env,
        )
        raised = phase(port, tokens, args, storm_size=args.storm, web_pid=web.pid)
        manage(
            "shell",
            "-c",
            "from agents.models import Agent; from agents.services import agent_set_shares; "
            "agent_set_shares(agent=Agent.objects.get(name='storm'), calls_in_flight=None, "
            "placements_in_flight=None, actor='bench')",
            env=env,
        )
        capped = phase(port, tokens, args, storm_size=args.storm, web_pid=web.pid)

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
