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
loader id; a script with bindings only a workerd of its own can give runs from a config
generated from its upload (`cfemulator.bound.BoundHost`), restarted when that changes.
Processes of deleted scripts idle until the next reset.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from capabilities.workerd.group import WorkerdGroup
from capabilities.workerd.host import WorkerdHost
from capabilities.workerd.supervision import Limits, SupervisedWorkerd
from cfemulator.bound import WORKER_OUTBOUND, BoundHost, needs_own_workerd
from cfemulator.limits import MAX_CPU_MS
from cfemulator.uploads import ScriptUpload
from sigil.ports import free_port_block, port_is_open

# Cloudflare allows 128 MB per isolate; workerd itself is about 50 MB resident, and the
# loader runtime's Worker holds every capability's isolate in one process: a backstop against
# a runaway allocation rather than the per-isolate limit, which one process cannot measure.
MEMORY_MB = 512
# A script may hold its event loop for its whole CPU limit, up to 5 min: the supervisor's own
# stall limit is only a backstop beyond it; the meter stops calls at their own limits. The
# probe interval bounds how soon the supervisor acts on the meter's kill.
LIMITS = Limits(stall_ms=MAX_CPU_MS + 1000, memory_mb=MEMORY_MB, probe_interval_ms=200)
_RESTART_SECONDS = 5.0


class _Ports:
    """The group's ports: one per name, kept for good (across restarts and resets), taken
    from blocks below the kernel's ephemeral range, where no outgoing connection can hold
    one when a process restarts on it. The emulator is one process, so no other needs to
    agree on them (unlike the local runtime's registry)."""

    BLOCK = 16

    def __init__(self) -> None:
        self._ports: dict[str, int] = {}
        self._free: list[int] = []
        self._lock = threading.Lock()

    def port_for(self, name: str) -> int:
        with self._lock:
            while name not in self._ports:
                if not self._free:
                    base = free_port_block(self.BLOCK)
                    self._free = list(range(base + self.BLOCK - 1, base - 1, -1))
                port = self._free.pop()
                # Another process may have picked an overlapping block since this one was.
                if not port_is_open(port):
                    self._ports[name] = port
            return self._ports[name]

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


class ScriptProcesses:
    """The supervised workerd of each script, by key (`script:{name}`, `ns:{namespace}:{name}`).

    Thread-safe. `stop_all` stops every process; the next call starts afresh.
    """

    def __init__(self, *, binary: str, state_dir: Path, code_dir: Path, secret: str) -> None:
        self.binary = binary
        self.state_dir = Path(state_dir)
        self.code_dir = Path(code_dir)
        #: the loader host's shared secret, sent with every call to a plain script
        self.secret = secret
        self.emulator_port = 0  # set once the emulator's socket is bound
        self._lock = threading.Lock()
        self._uploads: dict[str, tuple[str, ScriptUpload | None, str]] = {}
        self._ports = _Ports()
        self._group = self._new_group()

    def acquire(self, key: str, *, sha: str, upload: ScriptUpload | None = None, tails: str = "") -> ScriptProcess:
        """`key`'s process, started, or restarted for a bound script's new `sha`, as needed.
        Without an upload, a loader host that runs any bundle of the code directory. `tails`:
        "produce" when Tail Workers receive the script's events (it then runs from a config of
        its own), "consume" for the process that hands events to the script's `tail()`.

        Raises TimeoutError when it does not serve within 15 s.
        """
        bound = upload is not None and (needs_own_workerd(upload) or bool(tails))
        # A script that gains or loses such a binding changes process, as its host differs.
        name = f"{key}:bound" if bound else key
        with self._lock:
            self._uploads[name] = (sha, upload, tails)
            group = self._group
            supervised = group.get(name)
            replaced = None
            if bound and supervised is not None and supervised.host.sha != sha:
                supervised.host.upload, supervised.host.sha = upload, sha
                replaced = supervised.host.process
                supervised.restart()
        if replaced is not None:
            # Only once the old process is gone does `ensure` wait for the new one.
            deadline = time.monotonic() + _RESTART_SECONDS
            while supervised.host.process is replaced and time.monotonic() < deadline:
                time.sleep(0.01)
        group.ensure(name)
        return ScriptProcess(group.get(name))

    def stop_all(self) -> None:
        """Stop every process, together; later calls start new ones."""
        with self._lock:
            group, self._group = self._group, self._new_group()
            self._uploads.clear()
        group.stop()
        for directory in self.state_dir.glob("*"):
            shutil.rmtree(directory, ignore_errors=True)

    def _new_group(self) -> WorkerdGroup:
        return WorkerdGroup(self._make_host, LIMITS, self._ports)

    def _make_host(self, name: str, port: int) -> WorkerdHost:
        sha, upload, tails = self._uploads[name]
        directory = self.state_dir / name.replace(":", "-")
        if upload is None or not (needs_own_workerd(upload) or tails):
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
            upload=upload,
            sha=sha,
            emulator_port=self.emulator_port,
            script_port=self._ports.port_for(f"{name}:script"),
            tail_key=name.removesuffix(":bound") if tails == "produce" else None,
            tail_entry=tails == "consume",
            hands_back=name.startswith("ns:") and tails == "produce",
            kv_location=name.removesuffix(":bound"),
        )
