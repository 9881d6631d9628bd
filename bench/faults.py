"""Fault benchmark: what each process's death costs the callers, and whether accepted work is lost.

    .venv/bin/python bench/faults.py [--rate 20] [--settle-seconds 3]

It starts Sigil as `make run` does (`manage.py runsigil`: the bundled Redis with its
append-only file, workerd, a Celery worker with beat, granian) in a fresh temporary var
directory on 127.0.0.1, creates an agent and deploys two capabilities. Then, the whole time,
a caller sends `--rate` warm calls a second, and every half second an asynchronous call
(`Prefer: respond-async`) and every three seconds a deploy are accepted. One after another it
kills with SIGKILL, waiting each time until Sigil is healed (`/_health` ok and a call
answered 200) and `--settle-seconds` more:

- `workerd`: the agent's workerd process (its supervisor starts a fresh one);
- `web`: granian (runsigil's supervisor starts it again);
- `celery`: the Celery worker's main process, with what it held;
- `redis`: the bundled Redis, with the queue, the async calls and the counters in it.

For each fault it prints the calls answered ok and failed (by status) from the kill until
healed, and the seconds to heal. At the end it waits for every accepted piece of work to end
and prints how many were lost (an async call whose result never came or was `404`, a deploy
whose version never got placed): the target is 0.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import harness

from capabilities.workerd.group import read_status
from sigil.lifetime import PidFiles
from sigil.ports import free_port

AGENT = "bench"
PING = "export default { async fetch() { return new Response('pong') } }"
SLOW = "export default { async fetch() { await new Promise(r => setTimeout(r, 200)); return new Response('done') } }"
VERSIONED = "export default { async fetch() { return new Response('v%d') } }"
FAULTS = ("workerd", "web", "celery", "redis")
WORK_ENDS_SECONDS = 120


class Traffic(harness.Loops):
    """The callers: warm calls at a steady rate (each answer filed with its time), async calls
    and deploys accepted on the side (what was accepted, kept to be checked at the end)."""

    def __init__(self, port: int, tokens: dict[str, str], *, rate: float) -> None:
        self.port, self.tokens, self.rate = port, tokens, rate
        self.calls: list[tuple[float, int]] = []  # (when, status; 0: no answer)
        self.accepted_calls: list[str] = []  # status URLs
        self.accepted_versions: list[int] = []
        self.refused = Counter()  # what the work's requests got instead of being accepted
        self.lost = Counter()  # how the lost async calls ended, by status
        self.set_loops(self.call, self.accept)

    def send(
        self, connection, method: str, path: str, *, token: str, **kwargs
    ) -> tuple[int, bytes, http.client.HTTPConnection]:
        """One request, on a fresh connection when the last one broke: (status, body, connection)."""
        try:
            response, body = harness.request(
                connection, method, path, headers={**harness.bearer(token), **kwargs.pop("headers", {})}, **kwargs
            )
            return response.status, body, connection
        except (OSError, http.client.HTTPException):
            connection.close()
            return 0, b"", http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def call(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        pause = 1 / self.rate
        while self.running.is_set():
            started = time.monotonic()
            status, _, connection = self.send(connection, "GET", f"/{AGENT}/ping", token=self.tokens["invoke_token"])
            self.calls.append((started, status))
            time.sleep(max(0.0, pause - (time.monotonic() - started)))

    def accept(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        turn = 0
        while self.running.is_set():
            status, body, connection = self.send(
                connection,
                "GET",
                f"/{AGENT}/slow",
                token=self.tokens["invoke_token"],
                headers={"Prefer": "respond-async"},
            )
            if status == 202:
                self.accepted_calls.append(json.loads(body)["status_url"])
            else:
                self.refused[f"async {status}"] += 1
            if turn % 6 == 0:
                payload = json.dumps({"name": "versioned", "code": VERSIONED % turn}).encode()
                json_type = {"Content-Type": "application/json"}
                status, body, connection = self.send(
                    connection,
                    "POST",
                    "/_api/deploy",
                    token=self.tokens["deploy_token"],
                    body=payload,
                    headers=json_type,
                )
                if status in (200, 201, 202):  # 200: a new version of a capability that exists
                    self.accepted_versions.append(json.loads(body)["version"])
                else:
                    self.refused[f"deploy {status} {body[:120]!r}"] += 1
            turn += 1
            time.sleep(0.5)

    def answered_since(self, since: float, until: float) -> Counter:
        return Counter(status for at, status in self.calls if since <= at < until)


def victim(fault: str, var_dir: Path) -> int:
    """The pid the fault kills."""
    if fault == "workerd":
        return read_status(var_dir / "workerd" / "supervisor.json")["processes"][AGENT]["pid"]
    pid = PidFiles(var_dir / "run").running(fault)
    if pid is None:
        raise RuntimeError(f"no running {fault} recorded under {var_dir / 'run'}")
    return pid


def lost_work(port: int, traffic: Traffic) -> tuple[int, int]:
    """(async calls, deploys) accepted whose work never ended well, after waiting for it."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    deadline = time.monotonic() + WORK_ENDS_SECONDS
    pending = list(traffic.accepted_calls)
    lost_calls = 0
    while pending and time.monotonic() < deadline:
        still = []
        for url in pending:
            status, _, connection = traffic.send(connection, "GET", url, token=traffic.tokens["invoke_token"])
            if status in (0, 202):
                still.append(url)
            elif status != 200:
                lost_calls += 1  # 404: forgotten; a 5xx of Sigil's own: not run
                traffic.lost[status] += 1
        pending = still
        if pending:
            time.sleep(1)
    lost_calls += len(pending)

    def ended() -> set[int]:
        """The versions with an outcome (served, superseded, retired, refused): not placing."""
        nonlocal connection
        path = f"/_api/capabilities/{AGENT}--versioned/versions?limit=200"
        status, body, connection = traffic.send(connection, "GET", path, token=traffic.tokens["deploy_token"])
        rows = json.loads(body)["results"] if status == 200 else []
        return {row["version"] for row in rows if row["status"] != "placing"}

    wanted = set(traffic.accepted_versions)
    while not wanted <= ended() and time.monotonic() < deadline:
        time.sleep(1)
    return lost_calls, len(wanted - ended())


def main() -> int:
    args = harness.options(__doc__, rate=(20.0, "warm calls a second"), settle_seconds=(3.0, "calm after each heal"))

    var_dir, env = harness.local_sigil("faults")
    port = free_port()
    rows = []
    with harness.Processes() as processes:
        harness.manage("migrate", "--noinput", env=env)
        tokens = json.loads(harness.manage("createagent", AGENT, "--json", env=env))
        runsigil = processes.start(
            [sys.executable, harness.MANAGE, "runsigil", "--port", str(port)], env=env, log=var_dir / "runsigil.log"
        )
        harness.wait_for_health(port, runsigil, seconds=120)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        harness.deploy(connection, tokens["deploy_token"], "ping", PING)
        harness.deploy(connection, tokens["deploy_token"], "slow", SLOW)
        connection.close()
        with Traffic(port, tokens, rate=args.rate) as traffic:
            time.sleep(args.settle_seconds)
            for fault in FAULTS:
                pid = victim(fault, var_dir)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)  # the kill lands before the first probe
                harness.wait_until(
                    lambda: harness.serves(port, f"/{AGENT}/ping", tokens["invoke_token"]),
                    f"Sigil did not heal after {fault}",
                    seconds=120,
                )
                healed_at = time.monotonic()
                rows.append((fault, traffic.answered_since(killed_at, healed_at), healed_at - killed_at))
                time.sleep(args.settle_seconds)
        lost_calls, lost_deploys = lost_work(port, traffic)

    print(f"load average {harness.load_average()}; warm calls at {args.rate:g}/s")
    print(f"{'killed':<8} {'ok':>5} {'failed, by status':<32} {'healed in':>10}")
    for fault, answered, seconds in rows:
        failed = ", ".join(
            f"{status or 'none'}: {count}" for status, count in sorted(answered.items()) if status != 200
        )
        print(f"{fault:<8} {answered.get(200, 0):>5} {failed or '-':<32} {seconds:>9.1f}s")
    accepted = len(traffic.accepted_calls) + len(traffic.accepted_versions)
    print(
        f"accepted work: {len(traffic.accepted_calls)} async calls, {len(traffic.accepted_versions)} deploys; "
        f"lost {lost_calls} calls and {lost_deploys} deploys (target 0)"
    )
    if traffic.lost:
        print(f"lost async calls, by the status of their result: {dict(traffic.lost)}")
    if traffic.refused:
        print(f"work refused while a process was down: {dict(traffic.refused)}")
    return 0 if accepted and not (lost_calls or lost_deploys) else 1


if __name__ == "__main__":
    sys.exit(main())
