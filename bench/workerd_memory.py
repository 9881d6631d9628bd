"""workerd memory benchmark: does its resident memory plateau under steady calls and new versions?

    .venv/bin/python bench/workerd_memory.py [--calls 16000] [--versions 50] [--capabilities 20]

It runs all of Sigil as `make run` does (`manage.py runsigil`: the bundled Redis, workerd,
a Celery worker and the web server with the engine) in a fresh temporary var directory,
creates an agent, and over the REST API and the engine, on 127.0.0.1 only:

1. steady calls: `--calls` calls to one capability over 4 keep-alive connections, with no
   deploy in between, printing workerd's resident memory (RSS) as they go;
2. new versions: `--versions` deploys of new code for one capability, each version called
   20 times, printing RSS every tenth version;
3. capabilities: `--capabilities` new capabilities, each called 20 times, then removed:
   the RSS each one adds (the resident memory per capability) and what removal gives back;
   then as many others again, which should fit in the memory the removed ones freed (workerd's
   allocator keeps freed pages for reuse rather than return them all to the system).

workerd's RSS is read from /proc (Linux), summed over every workerd process Sigil runs. It
stops everything it started, by pid.
"""

from __future__ import annotations

import http.client
import json
import shutil
import sys
import threading
import time
from pathlib import Path

from harness import (
    Processes,
    deploy,
    load_average,
    local_sigil,
    manage,
    options,
    request,
    wait_for_health,
)
from invoke import cpu_seconds

from sigil.ports import free_port
from testsupport.processes import command_line, descendants, resident_mb, wait_until

AGENT = "bench"
# Each version keeps a little state of its own, as real capabilities do (a parsed config, a table).
CODE = """const table = Array.from({ length: 2000 }, (_, i) => ({ key: "k" + i, value: i }));
export default { async fetch(request) {
  return Response.json({ version: %s, rows: table.length, path: new URL(request.url).pathname });
} }"""
CONNECTIONS = 4
CALLS_PER_VERSION = 20


def workerd_pids(root: int) -> list[int]:
    return [pid for pid in descendants(root) if "workerd" in command_line(pid) and " serve " in command_line(pid)]


class Sigil:
    """The running Sigil: its port, the agent's tokens, and workerd's processes."""

    def __init__(self, port: int, tokens: dict[str, str], root_pid: int) -> None:
        self.port = port
        self.tokens = tokens
        self.root_pid = root_pid
        self.pids = workerd_pids(root_pid)
        if not self.pids:
            raise RuntimeError("no workerd process found under runsigil")

    def cpu(self) -> float:
        """CPU seconds workerd has used so far."""
        return sum(cpu_seconds(pid) for pid in self.pids)

    def rss(self) -> float:
        pids = workerd_pids(self.root_pid)
        if sorted(pids) != sorted(self.pids):
            print(f"  (workerd processes changed: {self.pids} -> {pids}; a restart resets its memory)")
            self.pids = pids
        return sum(resident_mb(pid) for pid in pids)

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def deploy(self, connection, name: str, code: str) -> None:
        deploy(connection, self.tokens["deploy_token"], name, code)

    def call(self, connection, name: str) -> None:
        headers = {"Authorization": f"Bearer {self.tokens['invoke_token']}"}
        response, data = request(connection, "GET", f"/{AGENT}/{name}", headers=headers)
        if response.status != 200:
            raise RuntimeError(f"the call of {name} answered {response.status}: {data[:300]!r}")

    def remove(self, connection, name: str) -> None:
        headers = {"Authorization": f"Bearer {self.tokens['deploy_token']}"}
        response, data = request(connection, "DELETE", f"/_api/capabilities/{AGENT}--{name}", headers=headers)
        if response.status not in (200, 202, 204):
            raise RuntimeError(f"the removal of {name} answered {response.status}: {data[:300]!r}")


def steady_calls(sigil: Sigil, calls: int) -> tuple[list[tuple[int, float]], float]:
    """`calls` calls to one capability over CONNECTIONS connections: RSS after each eighth,
    and workerd's CPU time per call in µs."""
    name = "steady"
    connection = sigil.connection()
    sigil.deploy(connection, name, CODE % 0)
    for _ in range(200):  # warm: the isolate, the engine's workers, the connections
        sigil.call(connection, name)
    connection.close()
    samples = [(0, sigil.rss())]
    cpu_before = sigil.cpu()
    failures: list[BaseException] = []

    def run(count: int) -> None:
        connection = sigil.connection()
        try:
            for _ in range(count):
                sigil.call(connection, name)
        except (OSError, RuntimeError) as exc:
            failures.append(exc)
        finally:
            connection.close()

    step = max(1, calls // 8)
    done = 0
    while done < calls:
        batch = min(step, calls - done)
        shares = [batch // CONNECTIONS + (1 if i < batch % CONNECTIONS else 0) for i in range(CONNECTIONS)]
        threads = [threading.Thread(target=run, args=(share,)) for share in shares]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        done += batch
        samples.append((done, sigil.rss()))
        print(f"  {done:6d} calls  workerd RSS {samples[-1][1]:7.1f} MB", flush=True)
    return samples, (sigil.cpu() - cpu_before) / calls * 1e6


def new_versions(sigil: Sigil, versions: int) -> list[tuple[int, float]]:
    name = "versioned"
    connection = sigil.connection()
    samples = []
    for version in range(1, versions + 1):
        sigil.deploy(connection, name, CODE % version)
        for _ in range(CALLS_PER_VERSION):
            sigil.call(connection, name)
        if version == 1 or version % 10 == 0 or version == versions:
            samples.append((version, sigil.rss()))
            print(f"  {version:6d} versions  workerd RSS {samples[-1][1]:7.1f} MB", flush=True)
    connection.close()
    return samples


def many_capabilities(sigil: Sigil, count: int, code_dir: Path, *, first: int) -> tuple[float, float, float]:
    """RSS before, with `count` more capabilities called, and after they were removed."""
    connection = sigil.connection()
    before = sigil.rss()
    names = [f"many-{first + i}" for i in range(count)]
    for i, name in enumerate(names):
        sigil.deploy(connection, name, CODE % (1000 + first + i))
        for _ in range(CALLS_PER_VERSION):
            sigil.call(connection, name)
    loaded = sigil.rss()
    print(f"  {count} capabilities called: workerd RSS {before:.1f} -> {loaded:.1f} MB", flush=True)
    for name in names:
        sigil.remove(connection, name)
    connection.close()
    # Removal ends in a Celery task that takes the code off workerd.
    slots = code_dir / "slots"
    wait_until(
        lambda: not any((slots / AGENT / f"{AGENT}--{name}").exists() for name in names),
        timeout=120,
        interval=0.5,
        what="the removed capabilities to leave the runtime",
    )
    time.sleep(1)
    removed = sigil.rss()
    print(f"  removed: workerd RSS {removed:.1f} MB", flush=True)
    return before, loaded, removed


def main() -> int:
    args = options(__doc__, calls=16000, versions=50, capabilities=20)

    var_dir, env = local_sigil("memory")
    port = free_port()

    with Processes() as processes:
        manage("migrate", "--noinput", env=env)
        tokens = json.loads(manage("createagent", AGENT, "--json", env=env))
        runsigil = processes.start(
            [sys.executable, "manage.py", "runsigil", "--port", str(port)], env=env, log=var_dir / "runsigil.log"
        )
        wait_for_health(port, runsigil, seconds=120)
        sigil = Sigil(port, tokens, runsigil.pid)
        started = sigil.rss()
        print(f"workerd RSS at start: {started:.1f} MB")

        print(f"steady calls to one capability ({CONNECTIONS} connections):")
        steady, cpu_per_call = steady_calls(sigil, args.calls)
        print(f"new versions of one capability, each called {CALLS_PER_VERSION} times:")
        versions = new_versions(sigil, args.versions)
        print(f"{args.capabilities} capabilities, each called {CALLS_PER_VERSION} times, then removed:")
        before, loaded, removed = many_capabilities(sigil, args.capabilities, var_dir / "code", first=0)
        print(f"{args.capabilities} other capabilities, the same way:")
        _, again, _ = many_capabilities(sigil, args.capabilities, var_dir / "code", first=args.capabilities)

    print()
    print(f"load average {load_average()}")
    half = steady[len(steady) // 2]
    print(
        f"steady calls: workerd RSS {steady[0][1]:.1f} MB after warm-up, {half[1]:.1f} MB after {half[0]} calls, "
        f"{steady[-1][1]:.1f} MB after {steady[-1][0]} "
        f"({(steady[-1][1] - half[1]) * 1024 / max(1, steady[-1][0] - half[0]):.2f} KB per call in the second half); "
        f"workerd's CPU {cpu_per_call:.0f} µs per call"
    )
    print(
        f"new versions: workerd RSS {versions[0][1]:.1f} MB at version 1, {versions[-1][1]:.1f} MB at "
        f"version {versions[-1][0]} ({(versions[-1][1] - versions[0][1]) / max(1, versions[-1][0] - 1):.2f} MB "
        "per version)"
    )
    print(
        f"capabilities: {(loaded - before) / max(1, args.capabilities):.2f} MB resident per capability "
        f"({args.capabilities} of them: {before:.1f} -> {loaded:.1f} MB); after their removal {removed:.1f} MB; "
        f"with {args.capabilities} others in their place {again:.1f} MB"
    )
    shutil.rmtree(var_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
