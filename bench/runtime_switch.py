"""Runtime switch benchmark: what agents' calls get while the owner switches runtimes.

    .venv/bin/python bench/runtime_switch.py [--rate 20] [--capabilities 4] [--to worker-pool]

It does what docs/operations.md tells the owner to do, as the owner does it: Sigil runs as
`make run` runs it (`make -o install run PORT=...`: `install` is skipped, it has nothing to
do on an installed machine and would only compare stamps), on the local runtime, in a fresh
temporary var directory with its bundled Redis. An agent deploys `--capabilities`
capabilities and a caller calls them in turn at `--rate` calls a second the whole time. Then,
to `--to` (the worker pool on the Cloudflare emulator that `make run` starts without
CF_API_TOKEN) and back to local:

1. Ctrl-C: SIGINT to `make run`'s process group, as a terminal sends it;
2. `make run` again at once, with SIGIL_BACKEND set to the other runtime;
3. `manage.py switchbackend` once Sigil says it is running.

For each switch it prints the restart's gap, from the last call answered `200` before the
stop to the first one after the start (and, within it, the longest time without any answer,
connections refused, and how many calls were answered `503` with `Retry-After`), then the
calls made while switchbackend ran, by status: the target is every one `200`.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import harness

from sigil.ports import free_port_block

AGENT = "bench"
RUNNING = "Sigil is running at"
CODE = "export default { async fetch() { return new Response(%s) } }"


@dataclass(frozen=True)
class Answer:
    sent: float  # monotonic
    done: float
    status: int  # 0: no answer (the connection was refused or broken)
    retry_after: bool = False


class Caller(harness.Loops):
    """Calls every capability in turn at `rate` a second, on one kept-alive connection
    (opened again when it breaks), filing each answer."""

    def __init__(self, port: int, token: str, names: list[str], *, rate: float) -> None:
        self.port, self.token, self.names, self.rate = port, token, names, rate
        self.answers: list[Answer] = []
        self.wrong: Counter = Counter()  # a 200 with another capability's body
        self.set_loops(self.run)

    def run(self) -> None:
        connection = None
        turn = 0
        while self.running.is_set():
            name = self.names[turn % len(self.names)]
            turn += 1
            sent = time.monotonic()
            if connection is None:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                response, body = harness.request(
                    connection, "GET", f"/{AGENT}/{name}", headers=harness.bearer(self.token)
                )
                status, retry_after = response.status, response.getheader("Retry-After") is not None
                if status == 200 and body.decode() != name:
                    self.wrong[name] += 1
                if response.getheader("Connection", "").lower() == "close":
                    connection.close()
                    connection = None
            except (OSError, http.client.HTTPException):
                connection.close()
                connection = None
                status, retry_after = 0, False
            self.answers.append(Answer(sent, time.monotonic(), status, retry_after))
            time.sleep(max(0.0, 1 / self.rate - (time.monotonic() - sent)))

    def between(self, since: float, until: float) -> list[Answer]:
        return [a for a in self.answers if since <= a.sent < until]


@dataclass(frozen=True)
class Switch:
    to: str
    gap: float  # the last 200 before the stop to the first 200 after the start
    refused: float  # the longest time in it without any answer
    answered_503: int
    other_in_gap: Counter
    stopped_in: float  # Ctrl-C to make's exit
    running_in: float  # make run to Sigil saying it runs
    switch_seconds: float
    during_switch: Counter
    output: str


class Owner:
    """The owner at the terminal: `make run` (its output in `log_path`), Ctrl-C, and
    switchbackend, with SIGIL_BACKEND set as the switch needs."""

    def __init__(self, port: int, env: dict[str, str], log_path) -> None:
        self.port, self.env, self.log_path = port, env, log_path
        self.make: subprocess.Popen | None = None
        self.started = 0

    def make_run(self, backend: str) -> None:
        """`make run` in a process group of its own, as a terminal runs it in the foreground;
        returns once Sigil says it is running."""
        self.env = {**self.env, "SIGIL_BACKEND": backend}
        command = ["make", "--no-print-directory", "-o", "install", "run", f"PORT={self.port}"]
        with open(self.log_path, "ab") as log:
            self.make = subprocess.Popen(
                command, cwd=harness.ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started += 1

        def said() -> bool:
            if self.make.poll() is not None:
                raise RuntimeError(f"make run exited with {self.make.returncode}; see {self.log_path}")
            return self.log_path.read_text(errors="replace").count(RUNNING) >= self.started

        harness.wait_until(said, "Sigil did not say it runs", seconds=180)

    def ctrl_c(self) -> None:
        """SIGINT to the foreground process group, as a terminal sends it; then wait for make to end."""
        if self.make is not None and self.make.poll() is None:
            os.killpg(self.make.pid, signal.SIGINT)
            self.make.wait(timeout=120)

    def switchbackend(self) -> str:
        """Its last line (its summary, or why it failed)."""
        done = subprocess.run(
            [sys.executable, harness.MANAGE, "switchbackend"],
            cwd=harness.ROOT,
            env=self.env,
            capture_output=True,
            text=True,
        )
        # Its own lines, not the log records (timestamped) of what it called.
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line and not line[:4].isdigit()]
        return f"{lines[-1] if lines else ''} (exit status {done.returncode})"


def switch(owner: Owner, caller: Caller, to: str) -> Switch:
    """The owner's switch to `to`: Ctrl-C, `make run` again with SIGIL_BACKEND=`to`, switchbackend."""
    time.sleep(2)  # calls answered before
    interrupted = time.monotonic()
    owner.ctrl_c()
    stopped = time.monotonic()
    owner.make_run(to)
    running = time.monotonic()
    output = owner.switchbackend()
    switched = time.monotonic()
    time.sleep(2)
    answers = sorted(caller.answers, key=lambda a: a.done)
    last_ok = max(a.done for a in answers if a.status == 200 and a.done < stopped)
    first_ok = min(a.done for a in answers if a.status == 200 and a.sent >= stopped)
    in_gap = [a for a in answers if last_ok < a.done < first_ok]
    # The longest time in the gap with no answer at all: connections refused.
    answered = [last_ok, *(a.done for a in in_gap if a.status), first_ok]
    refused = max(later - earlier for earlier, later in itertools.pairwise(answered))
    return Switch(
        to=to,
        gap=first_ok - last_ok,
        refused=refused,
        answered_503=sum(1 for a in in_gap if a.status == 503 and a.retry_after),
        other_in_gap=Counter(a.status for a in in_gap if a.status not in (0, 503)),
        stopped_in=stopped - interrupted,
        running_in=running - stopped,
        switch_seconds=switched - running,
        during_switch=Counter(a.status for a in caller.between(running, switched)),
        output=output,
    )


def main() -> int:
    args = harness.options(
        __doc__,
        rate=(20.0, "calls a second"),
        capabilities=4,
        to=("worker-pool", "the runtime to switch to from local, and back"),
    )
    var_dir, env = harness.local_sigil("switch", SIGIL_SWITCH_GRACE_SECONDS="2", SIGIL_LOG_LEVEL="INFO")
    names = [f"c{i}" for i in range(args.capabilities)]
    harness.manage("migrate", "--noinput", env=env)
    tokens = json.loads(harness.manage("createagent", AGENT, "--json", env=env))
    # Below the ephemeral ports, as the ports derived from it (workerd's, the emulator's) must be.
    owner = Owner(free_port_block(), env, var_dir / "make-run.log")
    results = []
    try:
        owner.make_run("local")
        connection = http.client.HTTPConnection("127.0.0.1", owner.port, timeout=30)
        for name in names:
            harness.deploy(connection, tokens["deploy_token"], name, CODE % json.dumps(name))
        connection.close()
        with Caller(owner.port, tokens["invoke_token"], names, rate=args.rate) as caller:
            for to in (args.to, "local"):
                results.append(switch(owner, caller, to))
    finally:
        owner.ctrl_c()

    print(f"load average {harness.load_average()}; {args.capabilities} capabilities called at {args.rate:g}/s")
    print(f"make run's output: {owner.log_path}")
    failed = False
    for result in results:
        print(f"to {result.to}:")
        print(
            f"  restart gap {result.gap:.1f} s (the last 200 before Ctrl-C to the first 200 after): "
            f"connections refused for {result.refused:.1f} s at most, {result.answered_503} calls answered 503 with "
            f"Retry-After" + (f", other answers {dict(result.other_in_gap)}" if result.other_in_gap else "")
        )
        print(f"  Ctrl-C to make's exit {result.stopped_in:.1f} s; make run to its banner {result.running_in:.1f} s")
        during = ", ".join(f"{status or 'none'}: {count}" for status, count in sorted(result.during_switch.items()))
        print(
            f"  switchbackend took {result.switch_seconds:.1f} s; calls meanwhile by status: {during} (target: all 200)"
        )
        print(f"  switchbackend said: {result.output}")
        failed |= set(result.during_switch) != {200} or not result.output.endswith("(exit status 0)")
    if caller.wrong:
        print(f"answers with another capability's body: {dict(caller.wrong)}")
    return 1 if failed or caller.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
