"""Every script runs in a workerd process of its own, supervised, started on its first call.

On Cloudflare each script runs in isolates of its own: one that spins or runs out of memory
is stopped (error 1102) while every other script keeps answering. One open-source workerd
runs all its Workers on one event loop, so a script that spins stops everything in its
process; the emulator therefore gives each script a process of its own (about 10 MB of its
own memory, 30 ms to start) under `capabilities.workerd.supervision`, which stops it when its
memory passes `MEMORY_MB` or the CPU meter (`cfemulator.cpumeter`) finds a call past its
limit, and starts a fresh one at once.

A plain script runs as a Dynamic Worker of the loader host (`capabilities/runtimes/host`),
which reads its bundle from the emulator's code directory and runs any version by its
loader id, each call the version it was sent for: a new version takes nothing from the calls
the old one serves. A script with bindings only a workerd of its own can give runs from a
config generated from its upload (`cfemulator.bound.BoundHost`), one process per version:
as on Cloudflare, a new version does not cut the calls the old one is serving. Its process
starts (on a port of its own) with the first call that asks for it, new calls go there once
it serves, and the old process stays until the calls it serves have ended (calls in flight
are counted per process, a WebSocket session for as long as it lasts), then is stopped; at
the latest DRAIN_SECONDS after it was replaced, which cuts what still runs there. Processes
of deleted scripts idle until the next reset.
A Worker Loader's Dynamic Workers run in processes of this group too, runners named
`dynamic:{n}` (`cfemulator.dynamic`).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capabilities.workerd.group import WorkerdGroup
from capabilities.workerd.host import WorkerdHost
from capabilities.workerd.supervision import Limits, SupervisedWorkerd
from cfemulator.bound import WORKER_OUTBOUND, BoundHost, needs_own_workerd
from cfemulator.dynamic_host import DynamicHost
from cfemulator.limits import MAX_CPU_MS
from cfemulator.uploads import ScriptUpload
from sigil.ports import HeldPort

logger = logging.getLogger(__name__)

# Cloudflare allows 128 MB per isolate; workerd itself is about 50 MB resident, and the
# loader runtime's Worker holds every capability's isolate in one process: a backstop against
# a runaway allocation rather than the per-isolate limit, which one process cannot measure.
MEMORY_MB = 512
# A script may hold its event loop for its whole CPU limit, up to 5 min: the supervisor's own
# stall limit is only a backstop beyond it; the meter stops calls at their own limits. The
# probe interval bounds how soon the supervisor acts on the meter's kill.
LIMITS = Limits(stall_ms=MAX_CPU_MS + 1000, memory_mb=MEMORY_MB, probe_interval_ms=200)
# How long a bound script's replaced version may go on serving the calls it had: Cloudflare
# lets the processes of a previous version drain their requests and connections for up to 20
# minutes before it cuts them (changelog 2026-10-12, on its runtime updates; 30 s before),
# and each call is held to its own CPU limit meanwhile (the meter). No source gives a figure
# for a new deployment of a Worker: the emulator applies the same bound.
DRAIN_SECONDS = 20 * 60
# The names of the processes that run Dynamic Workers (cfemulator.dynamic).
RUNNER_PREFIX = "dynamic:"


class _Ports:
    """The group's ports: one per name, chosen by the kernel and held until the name's process
    is stopped for good (`HeldPort`), so that its restarts find it free and no other program,
    another checkout's emulator included, is given it meanwhile. The emulator is one process,
    so no other needs to agree on them (unlike the local runtime's registry)."""

    def __init__(self) -> None:
        self._held: dict[str, HeldPort] = {}
        self._lock = threading.Lock()

    def port_for(self, name: str) -> int:
        with self._lock:
            held = self._held.get(name)
            if held is None:
                held = self._held[name] = HeldPort()
            return held.port

    def release(self, name: str) -> None:
        """Let `name`'s port go (its process is stopped)."""
        with self._lock:
            held = self._held.pop(name, None)
        if held is not None:
            held.close()

    def release_all(self) -> None:
        """Let every port go (the emulator stops)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for port in held:
            port.close()

    def names(self) -> list[str]:
        return []  # processes start on a call, never ahead of one


@dataclass(frozen=True)
class ScriptProcess:
    """One script's supervised workerd, as a call finds it."""

    supervised: SupervisedWorkerd

    @property
    def port(self) -> int:
        """Where the script answers (a bound script's probe has a port of its own)."""
        host = self.supervised.host
        return host.script_port if isinstance(host, BoundHost) else host.port

    @property
    def pid(self) -> int | None:
        process = self.supervised.host.process
        return process.pid if process is not None else None

    def silent(self) -> bool:
        """Whether its event loop has left the supervisor's probe unanswered for a while."""
        return self.supervised.blame_ends_at() is not None

    def stop_for_cpu(self) -> None:
        """Have the supervisor kill it now (a call ran past its CPU limit) and start a fresh one."""
        self.supervised.kill("cpu")

    def stopped_for(self, sent_at: float) -> str | None:
        """Why the supervisor stopped it with a call sent at `sent_at` (epoch) in flight
        ("cpu", "memory"), when that call can be the cause; None otherwise."""
        kill = self.supervised.last_kill
        return kill.reason if kill is not None and kill.at >= sent_at and kill.blames(sent_at) else None


@dataclass(eq=False)
class _Process:
    """One process of the group: the version it runs, and the calls it serves now."""

    name: str  # its name in the group: the key, or for a bound script the key and version
    key: str
    sha: str
    upload: ScriptUpload | None
    tails: str
    generation: int
    calls: int = 0
    #: monotonic time it was replaced by a newer version; None while it is the one served
    replaced_at: float | None = None
    drained: threading.Timer | None = None

    @property
    def bound(self) -> bool:
        return self.upload is not None and (needs_own_workerd(self.upload) or bool(self.tails))


class ScriptProcesses:
    """The supervised workerd of each script, by key (`script:{name}`, `ns:{namespace}:{name}`,
    `tail:{name}`); a bound script's has one per version.

    Thread-safe. `stop_all` stops every process; the next call starts afresh.
    """

    def __init__(self, *, binary: str, state_dir: Path, code_dir: Path, secret: str) -> None:
        self.binary = binary
        self.state_dir = Path(state_dir)
        self.code_dir = Path(code_dir)
        #: where the Dynamic Workers' code is kept, for their runners to read (cfemulator.dynamic),
        #: sealed under a key of this process's that only the runners' environment holds
        self.dynamic_code_dir = self.state_dir.parent / "dynamic-code"
        self.dynamic_code_key = os.urandom(32)
        #: the loader host's shared secret, sent with every call to a plain script
        self.secret = secret
        self.emulator_port = 0  # set once the emulator's socket is bound
        self._lock = threading.Lock()
        self._processes: dict[str, _Process] = {}  # by name
        self._served: dict[str, str] = {}  # a bound script's key -> the name of the version new calls get
        self._ports = _Ports()
        self._group = self._new_group()

    @contextlib.contextmanager
    def calling(
        self, key: str, *, sha: str, upload: ScriptUpload | None = None, tails: str = "", generation: int = 0
    ) -> Iterator[ScriptProcess]:
        """`key`'s process, started as needed, with one more call in flight on it until the
        block ends. Without an upload, a loader host that runs any bundle of the code
        directory. `tails`: "produce" when Tail Workers receive the script's events (it then
        runs from a config of its own), "consume" for the process that hands events to the
        script's `tail()`. `generation` orders the uploads (`Script.generation`): a call for a
        version older than the one served goes to the one served (it was replaced before
        the call reached it), one for a newer version starts that version's process, which
        new calls get once it serves; the process it replaces is stopped once its last call
        has ended.

        Raises TimeoutError when it does not serve within 15 s.
        """
        process = self._enter(key, sha=sha, upload=upload, tails=tails, generation=generation)
        try:
            group = self._group
            group.ensure(process.name)
            self._serve(process)
            yield ScriptProcess(group.get(process.name))
        finally:
            self._leave(process)

    def acquire(self, key: str, *, sha: str, upload: ScriptUpload | None = None, tails: str = "") -> ScriptProcess:
        """`key`'s process, as `calling` finds it, for a use that is no call of the script's
        (a start check). Raises TimeoutError when it does not serve within 15 s."""
        with self.calling(key, sha=sha, upload=upload, tails=tails) as running:
            return running

    def describe(self) -> list[dict[str, Any]]:
        """Every process, as the emulator's controls show it: its key, version, pid, port, state and
        the calls in flight on it, and whether it was replaced (it only drains)."""
        with self._lock:
            processes = list(self._processes.values())
            group = self._group
        described = []
        for process in processes:
            supervised = group.get(process.name)
            snapshot = supervised.snapshot() if supervised is not None else {"pid": None, "state": "starting"}
            described.append(
                {
                    "key": process.key,
                    "name": process.name,
                    "sha": process.sha,
                    "generation": process.generation,
                    "pid": snapshot["pid"],
                    "port": ScriptProcess(supervised).port if supervised is not None else None,
                    "state": snapshot["state"],
                    "calls": process.calls,
                    "replaced": process.replaced_at is not None,
                }
            )
        return described

    def acquire_runner(self, name: str) -> ScriptProcess:
        """The Dynamic Worker runner `name` (`RUNNER_PREFIX`…), started as needed.

        Raises TimeoutError when it does not serve within 15 s."""
        with self._lock:
            group = self._group
        group.ensure(name)
        return ScriptProcess(group.get(name))

    def running(self, name: str) -> ScriptProcess | None:
        """The process `name` while it serves; None otherwise. Starts nothing."""
        with self._lock:
            supervised = self._group.get(name)
        return ScriptProcess(supervised) if supervised is not None and supervised.serving() else None

    def retire(self, name: str) -> None:
        """Stop the process `name` and forget it; the next `acquire` of it starts a fresh one."""
        with self._lock:
            group = self._group
        group.retire(name)

    def stop_all(self) -> None:
        """Stop every process, together; later calls start new ones."""
        with self._lock:
            ports, self._ports = self._ports, _Ports()  # the old group's, let go once it stopped
            group, self._group = self._group, self._new_group()
            for process in self._processes.values():
                if process.drained is not None:
                    process.drained.cancel()
            self._processes.clear()
            self._served.clear()
        group.stop()
        ports.release_all()
        for directory in self.state_dir.glob("*"):
            shutil.rmtree(directory, ignore_errors=True)

    def _enter(self, key: str, *, sha: str, upload: ScriptUpload | None, tails: str, generation: int) -> _Process:
        """The process a call for `key`'s version `generation` goes to, with the call counted
        on it (so that no drain stops it under the call)."""
        wanted = _Process(name=key, key=key, sha=sha, upload=upload, tails=tails, generation=generation)
        with self._lock:
            if wanted.bound:
                served = self._processes.get(self._served.get(key, ""))
                if served is not None and (
                    generation <= served.generation or (served.sha, served.upload) == (sha, upload)
                ):
                    # An older version's call, or the same code uploaded again: the one served.
                    served.generation = max(served.generation, generation)
                    wanted = served
                else:
                    wanted.name = f"{key}:bound@{generation}"
            process = self._processes.setdefault(wanted.name, wanted)
            if not process.bound:
                process.sha, process.upload, process.tails = sha, upload, tails
            process.calls += 1
            return process

    def _serve(self, process: _Process) -> None:
        """`process` serves: new calls for its script go to it if it runs its newest version,
        and the version it replaces drains; if a newer one is served already, it drains."""
        if not process.bound:
            return
        with self._lock:
            served = self._processes.get(self._served.get(process.key, ""))
            if served is process or process.replaced_at is not None:
                return
            if served is None or served.generation < process.generation:
                self._served[process.key] = process.name
                replaced = served
            else:
                replaced = process
            if replaced is not None:
                logger.info(
                    "%s: a newer version serves; the process of version %s drains", replaced.key, replaced.generation
                )
                self._drain_locked(replaced)

    def _leave(self, process: _Process) -> None:
        with self._lock:
            process.calls -= 1
            if process.replaced_at is not None and process.calls == 0:
                self._retire_locked(process, why="its last call ended")

    def _drain_locked(self, process: _Process) -> None:
        process.replaced_at = time.monotonic()
        if process.calls == 0:
            self._retire_locked(process, why="it served no call")
            return
        process.drained = threading.Timer(
            DRAIN_SECONDS, self._drain_ended, args=(process,), kwargs={"group": self._group}
        )
        process.drained.daemon = True
        process.drained.start()

    def _drain_ended(self, process: _Process, *, group: WorkerdGroup) -> None:
        with self._lock:
            if self._processes.get(process.name) is process and self._group is group:
                self._retire_locked(process, why=f"its calls ran past {DRAIN_SECONDS} s, and were cut")

    def _retire_locked(self, process: _Process, *, why: str) -> None:
        """Forget `process` and stop it in the background (its stop waits for workerd to exit)."""
        if self._processes.get(process.name) is not process:
            return
        del self._processes[process.name]
        if process.drained is not None:
            process.drained.cancel()
        group, ports = self._group, self._ports
        logger.info("stopping %s, replaced by a newer version: %s", process.name, why)
        threading.Thread(
            target=self._stop_retired, args=(group, ports, process.name), name=f"retire-{process.name}", daemon=True
        ).start()

    def _stop_retired(self, group: WorkerdGroup, ports: _Ports, name: str) -> None:
        group.retire(name)
        ports.release(name)
        ports.release(f"{name}:script")
        shutil.rmtree(self._directory(name), ignore_errors=True)

    def _directory(self, name: str) -> Path:
        return self.state_dir / name.replace(":", "-")

    def _new_group(self) -> WorkerdGroup:
        return WorkerdGroup(self._make_host, LIMITS, self._ports)

    def _make_host(self, name: str, port: int) -> WorkerdHost:
        directory = self._directory(name)
        if name.startswith(RUNNER_PREFIX):
            return DynamicHost(
                binary=self.binary,
                port=port,
                code_dir=self.code_dir,
                state_dir=directory,
                secret=self.secret,
                emulator_port=self.emulator_port,
                dynamic_code_dir=self.dynamic_code_dir,
                code_key=base64.b64encode(self.dynamic_code_key).decode(),
            )
        with self._lock:
            process = self._processes.get(name)
        if process is None:  # every process was stopped (a reset) since the call asked for it
            raise RuntimeError(f"the emulator was reset while {name} was started")
        if not process.bound:
            return WorkerdHost(
                binary=self.binary,
                port=port,
                code_dir=self.code_dir,
                state_dir=directory,
                secret=self.secret,
                outbound_allow=WORKER_OUTBOUND,
            )
        return BoundHost(
            binary=self.binary,
            port=port,
            code_dir=self.code_dir,
            state_dir=directory,
            secret=self.secret,
            upload=process.upload,
            sha=process.sha,
            emulator_port=self.emulator_port,
            script_port=self._ports.port_for(f"{name}:script"),
            tail_key=process.key if process.tails == "produce" else None,
            tail_entry=process.tails == "consume",
            hands_back=process.key.startswith("ns:") and process.tails == "produce",
            owner=name,
            kv_location=process.key,
        )
