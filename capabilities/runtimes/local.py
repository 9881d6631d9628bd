"""The local runtime: capability code runs in workerd on this machine, through the loader host,
one workerd process per agent (see LocalProcesses)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import urllib3
from django.conf import LazySettings
from django.core.checks import CheckMessage, Error

from capabilities.log_limits import LogLimits
from capabilities.runtimes.base import TEXT_BINDING_KINDS, CallStopped, CodeBundle, Process, Route, Runtime
from capabilities.runtimes.errors import RuntimeRejected, RuntimeUnavailable
from capabilities.runtimes.loader_host import loader_host_retire, loader_host_start_check
from capabilities.workerd.group import Companion, PortRegistry, WorkerdGroup, read_status
from capabilities.workerd.host import WorkerdHost
from capabilities.workerd.supervision import Kill, KillLog, Limits
from sigil.files import write_atomically
from sigil.lifetime import start_time

# Time the watchdog grants past the CPU budget before it calls a process stalled: a loaded
# machine can delay a probe's answer, and killing an innocent process costs its agent calls.
STALL_MARGIN_MS = 500
# The CPU budget when SIGIL_CPU_MS is 0 ("Cloudflare's default"): Cloudflare's 30 s.
DEFAULT_CPU_MS = 30_000
# A call refused within this long after its process was stopped is told to come back
# (503 unavailable) rather than blamed on the runtime (502): a fresh process is starting.
RESTART_GRACE_SECONDS = 10.0
# How long a placement waits for the supervisor to start a new agent's process.
PROCESS_START_SECONDS = 15.0
# An idle workerd with the loader host already takes about 60 MB: a lower limit would have
# the watchdog stop it as soon as it starts, again and again.
MIN_MEMORY_MB = 128


class CallRecordSink(Companion, Protocol):
    """Where the hosts post their calls' records (capabilities/log_sink.py), served beside the
    group: its port, and the per-call bounds the hosts apply."""

    port: int
    limits: LogLimits


def _listing(directory: Path) -> list[Path]:
    """The entries of `directory`; none when it does not exist (or no longer does)."""
    try:
        return list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


@dataclass(frozen=True)
class Placements:
    """The local runtime's placements on disk: one pointer `{code_dir}/slots/{tenant}/{slot}`
    per placed slot, holding its bundle's sha, filed under the agent (the tenant) whose
    workerd serves it, so that the supervisor knows which agents have placements."""

    code_dir: Path

    @property
    def root(self) -> Path:
        return Path(self.code_dir) / "slots"

    def pointer(self, *, slot: str, tenant: str) -> Path:
        return self.root / tenant / slot

    def pointers(self) -> list[Path]:
        """Every pointer: a listing of `slots/`, and one per agent with a directory there. A
        directory removed while it is listed holds none (the supervisor lists them every
        second, and must not stop every process because one went away)."""
        return [
            pointer
            for tenant in _listing(self.root)
            if tenant.is_dir() and not tenant.name.startswith(".")
            for pointer in _listing(tenant)
            if pointer.is_file() and not pointer.name.startswith(".")
        ]

    def find(self, slot: str) -> Path | None:
        """The pointer of `slot`, under whichever agent it is filed; None when it is not placed."""
        return next((pointer for pointer in self.root.glob(f"*/{slot}") if pointer.is_file()), None)

    def tenants(self) -> set[str]:
        """The agents with at least one placement."""
        return {pointer.parent.name for pointer in self.pointers()}

    def file_flat_pointers(self) -> None:
        """File under their agent the pointers an older Sigil kept flat in `slots/`, named by
        the capability's full name (`agent--name`), which names its agent. Idempotent."""
        if not self.root.is_dir():
            return
        for pointer in self.root.iterdir():
            if pointer.is_file() and not pointer.name.startswith("."):
                filed = self.pointer(slot=pointer.name, tenant=pointer.name.partition("--")[0])
                filed.parent.mkdir(parents=True, exist_ok=True)
                pointer.replace(filed)


@dataclass(frozen=True)
class LocalProcesses:
    """Where the local runtime's workerd processes are, as every process on the machine
    (web, Celery, runworkerd) sees them, through files under `state_dir`.

    Each agent's capabilities run in a workerd of their own (named by the agent, the tenant
    the runtime is given with each slot), so a capability that spins or bloats stalls only
    its own agent's process. Ports are `base_port` + an index the registry allocates on an
    agent's first placement and keeps, so routes cached by the engine stay valid across
    restarts. The supervisor (runworkerd) writes a status file and, before it kills a
    process, a kill record.

    An agent with nothing placed any more (its last capability removed, or the agent gone)
    has its process stopped once `idle_after_seconds` have passed since a placement last
    asked for it (`want`); its next placement asks again, and the supervisor starts it.
    """

    state_dir: Path
    base_port: int
    idle_after_seconds: float = 60.0

    @property
    def registry(self) -> PortRegistry:
        return PortRegistry(self.state_dir / "ports.json", self.base_port)

    @property
    def kill_log(self) -> KillLog:
        return KillLog(self.state_dir / "kills")

    @property
    def status_path(self) -> Path:
        return self.state_dir / "supervisor.json"

    def want(self, name: str) -> None:
        """A placement for `name` is under way: its process is needed (for idle_after_seconds
        at least, whatever is placed meanwhile)."""
        stamp = self.state_dir / "wanted" / name
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()

    def idle(self, names: list[str], *, code_dir: Path, since: float = 0.0) -> set[str]:
        """Which of `names` have no placement under `code_dir` and were not wanted lately,
        counting from `since` (epoch; the supervisor's start: a process it just started is
        not idle yet). A directory listing per agent, and one stat per name without a placement."""
        placed = Placements(code_dir).tenants()
        cutoff = time.time() - self.idle_after_seconds
        idle = set()
        for name in set(names) - placed:
            try:
                wanted_at = (self.state_dir / "wanted" / name).stat().st_mtime
            except FileNotFoundError:
                wanted_at = since
            if wanted_at < cutoff:
                idle.add(name)
        return idle

    def group(
        self,
        *,
        code_dir: Path,
        binary: str,
        secret: str,
        limits: Limits,
        own_session: bool,
        log_sink: CallRecordSink | None = None,
    ) -> WorkerdGroup:
        """The supervisor's side: one supervised workerd per agent in the registry, which
        first takes in every agent with a placement (made before the registry existed, or
        while it was lost), so their calls find a process at once. With `log_sink`, every
        process's host posts the calls' records there, and the sink serves while the group runs."""
        placements = Placements(code_dir)
        placements.file_flat_pointers()
        for tenant in sorted(placements.tenants()):
            self.registry.port_for(tenant)

        def make_host(name: str, port: int) -> WorkerdHost:
            # A directory per process: each writes its config and copies the host module there.
            return WorkerdHost(
                binary=binary,
                port=port,
                code_dir=code_dir,
                state_dir=self.state_dir / "processes" / name,
                secret=secret,
                own_session=own_session,
                log_sink_port=log_sink.port if log_sink else None,
                log_limits=log_sink.limits.for_host() if log_sink else None,
            )

        started = time.time()  # a process the group starts is not idle before its time
        return WorkerdGroup(
            make_host,
            limits,
            self.registry,
            kill_log=self.kill_log,
            status_path=self.status_path,
            idle=lambda names: self.idle(names, code_dir=code_dir, since=started),
            companions=[log_sink] if log_sink else [],
        )


def local_limits(*, cpu_ms: int, memory_mb: int) -> Limits:
    """The watchdog's limits for SIGIL_CPU_MS and SIGIL_WORKERD_MEMORY_MB."""
    return Limits(stall_ms=(cpu_ms or DEFAULT_CPU_MS) + STALL_MARGIN_MS, memory_mb=memory_mb)


def local_processes() -> LocalProcesses:
    """The local runtime's processes as Sigil's settings place them."""
    from django.conf import settings

    return LocalProcesses(state_dir=settings.VAR_DIR / "workerd", base_port=settings.SIGIL_WORKERD_PORT)


logger = logging.getLogger(__name__)


class LocalRuntime(Runtime):
    """Code is stored content-addressed (`{code_dir}/{sha}.json`) and read by the host; its
    secrets are stored sealed for the host (CodeBundle.to_json), never in plain text.

    A placement is a small pointer file `{code_dir}/slots/{tenant}/{full name}` holding the
    sha (Placements), so that `list_slots` sees what is placed, `remove` knows which bundle
    may be freed, and the supervisor which agents have placements.
    Calls go to the workerd of the capability's agent (LocalProcesses), which runworkerd
    starts once the agent's first placement registers it.
    """

    name = "local"
    # workerd on this machine has no Cloudflare account behind it: only values can be given.
    binding_kinds = TEXT_BINDING_KINDS

    @classmethod
    def settings_errors(cls, settings: LazySettings) -> list[CheckMessage]:
        if settings.SIGIL_WORKERD_MEMORY_MB < MIN_MEMORY_MB:
            memory = f"SIGIL_WORKERD_MEMORY_MB is {settings.SIGIL_WORKERD_MEMORY_MB}"
            return [Error(memory, hint=f"Use {MIN_MEMORY_MB} (MB) or more.", id="sigil.E011")]
        return []

    @classmethod
    def processes(cls, settings: LazySettings) -> list[Process]:
        """The workerd supervisor (`manage.py runworkerd`), ready once its status says that
        every agent's process has started (served, or failed and is being restarted): the
        web server, which starts after it, then finds them serving."""
        status_path = local_processes().status_path
        supervisor = Process(
            name="workerd",
            command="runworkerd",
            port=settings.SIGIL_WORKERD_PORT,
            port_name="workerd's port",
            port_hint="set SIGIL_WORKERD_PORT",
            description=f"one workerd per agent on 127.0.0.1:{settings.SIGIL_WORKERD_PORT} and up",
            ready=lambda: _started(read_status(status_path)),
        )
        return [supervisor]

    @classmethod
    def from_settings(cls) -> LocalRuntime:
        from django.conf import settings

        return cls(
            code_dir=settings.SIGIL_CODE_DIR,
            processes=local_processes(),
            secret=settings.SIGIL_INTERNAL_SECRET,
            max_slots=settings.SIGIL_LOCAL_SLOTS or None,
            safety_margin=settings.SIGIL_POOL_SAFETY_MARGIN,
        )

    def __init__(
        self,
        *,
        code_dir: Path,
        processes: LocalProcesses,
        secret: str,
        max_slots: int | None = None,
        safety_margin: int = 0,
    ) -> None:
        self.max_slots = max_slots
        self.margin = safety_margin
        self.code_dir = Path(code_dir)
        self.placements = Placements(self.code_dir)
        self.processes = processes
        self._registry = processes.registry
        self._kill_log = processes.kill_log
        self._secret = secret
        self._start_checks = urllib3.PoolManager(timeout=urllib3.Timeout(connect=1.0, read=30.0), retries=False)

    @property
    def total_slots(self) -> int | None:
        return self.max_slots

    @property
    def safety_margin(self) -> int:
        return self.margin

    def slot_for(self, full_name: str, *, attempt: int = 0) -> str:
        return full_name  # full names are unique, so they never collide

    def place(self, *, slot: str, bundle: CodeBundle, tenant: str) -> None:
        """Store the bundle (once per sha), have the host start it, and point the slot at it.
        Idempotent. Raises RuntimeRejected when the code does not start (or its top-level
        code runs past the CPU or memory limit), RuntimeUnavailable when the agent's workerd
        does not serve (runworkerd not running)."""
        pointer = self.placements.pointer(slot=slot, tenant=tenant)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        self._wait_for_process(tenant)
        bundle_path = self.code_dir / f"{bundle.sha}.json"
        stored_now = not bundle_path.exists()
        # Sealed secrets are written again each time: a bundle sealed for an earlier
        # internal secret cannot be opened by the host now running.
        if stored_now or bundle.secrets:
            write_atomically(bundle_path, bundle.to_json(seal_key=self._secret))
        try:
            started = self._start_check(slot, bundle.sha, tenant)
            if not started:
                raise RuntimeUnavailable(f"workerd does not find the code just stored in {bundle_path}")
        except RuntimeRejected:
            if stored_now:
                bundle_path.unlink(missing_ok=True)
            raise
        previous = _pointed_sha(pointer)
        write_atomically(pointer, bundle.sha.encode())
        if previous not in (None, bundle.sha):
            self._drop_if_unused(previous)  # the replaced code (and any old secret it held)

    def remove(self, *, slot: str) -> None:
        """Drop the slot's pointer, its bundle when no other slot uses it, and its isolate in
        workerd. Idempotent."""
        pointer = self.placements.find(slot)
        sha = _pointed_sha(pointer) if pointer else None
        if sha is None:
            return
        tenant = pointer.parent.name
        pointer.unlink(missing_ok=True)
        self._drop_if_unused(sha)
        # The host retires a replaced version by itself, but a removed slot is never called
        # again: without this, its isolate would stay until workerd restarts.
        try:
            loader_host_retire(self._start_checks, self.route(slot=slot, sha=sha, tenant=tenant))
        except RuntimeUnavailable as exc:
            # The slot is gone all the same; a workerd that cannot be reached holds nothing
            # once it is restarted.
            logger.warning("workerd did not release %s@%s: %s", slot, sha, exc)

    def _drop_if_unused(self, sha: str) -> None:
        if not any(_pointed_sha(p) == sha for p in self.placements.pointers()):
            (self.code_dir / f"{sha}.json").unlink(missing_ok=True)

    def _start_check(self, slot: str, sha: str, tenant: str) -> bool:
        """The loader host's start check, on the agent's process. Raises RuntimeRejected when
        the code's top-level code runs past a limit and has the process stopped."""
        for attempt in range(2):
            sent_at = time.time()
            try:
                return loader_host_start_check(self._start_checks, self.route(slot=slot, sha=sha, tenant=tenant))
            except RuntimeUnavailable:
                stopped = self.call_stopped(slot=slot, tenant=tenant, sent_at=sent_at)
                if stopped is None or attempt:
                    raise
                if stopped.culprit:
                    raise RuntimeRejected(f"the code {stopped.message} while starting") from None
                # The process was stopped for another call (or was restarting): the check
                # runs no handler, so it is asked again of the fresh process.
                self._wait_for_process(tenant, after=sent_at)
        raise AssertionError("unreachable")

    def _wait_for_process(self, name: str, *, after: float = 0.0) -> None:
        """Register `name` (its first placement) and wait until the supervisor serves it (with
        a process that started serving after `after`, an epoch)."""
        self.processes.want(name)  # before the supervisor could find it idle and stop it
        port = self._registry.port_for(name)
        deadline = time.monotonic() + PROCESS_START_SECONDS
        while True:
            status = read_status(self.processes.status_path)
            if status is None:
                raise RuntimeUnavailable(
                    f"no workerd supervisor writes {self.processes.status_path}: is `manage.py runworkerd` running?"
                )
            entry = status["processes"].get(name)
            if entry is not None and entry["state"] == "serving" and entry["port"] == port and entry["since"] > after:
                return
            if time.monotonic() >= deadline:
                state = entry["state"] if entry else "not started"
                raise RuntimeUnavailable(f"workerd for {name} is {state} after {PROCESS_START_SECONDS:g} s")
            time.sleep(0.05)

    def url_for(self, tenant: str) -> str:
        """The base URL of the workerd that serves `tenant`'s slots (reads the port registry
        once per agent)."""
        return f"http://127.0.0.1:{self._registry.port_for(tenant)}"

    def route(self, *, slot: str, sha: str, tenant: str, cpu_ms: int | None = None) -> Route:
        return Route(
            base_url=self.url_for(tenant),
            headers=(("X-Sigil-Secret", self._secret), ("X-Sigil-Loader-Id", f"{slot}@{sha}")),
        )

    def list_slots(self) -> list[str]:
        return sorted(pointer.name for pointer in self.placements.pointers())

    def call_stopped(self, *, slot: str, tenant: str, sent_at: float) -> CallStopped | None:
        """Why the slot's process stopped under a call sent at `sent_at`: the watchdog's kill
        record, when it stopped the process after the call was sent (or shortly before, while
        the fresh one was not serving yet); else the process's own exit, when the one that
        took the call is gone."""
        name = tenant
        status = read_status(self.processes.status_path) or {"processes": {}}
        entry = status["processes"].get(name)
        kill = self._kill_log.latest(name)
        if kill is None or kill.at < sent_at - RESTART_GRACE_SECONDS:
            return _exited_under(entry, sent_at)
        if kill.at < sent_at:
            if entry is not None and entry["state"] == "serving" and kill.at <= entry["since"] <= sent_at:
                return _exited_under(entry, sent_at)  # a fresh process served when the call was sent
            return CallStopped(culprit=False, reason=kill.reason, message=kill.describe())
        return CallStopped(culprit=kill.blames(sent_at), reason=kill.reason, message=kill.describe())

    def check(self) -> None:
        """The supervisor is running and reports every agent's workerd serving (it probes
        each one every 100 ms, so its word is fresher than one probe from here)."""
        status = read_status(self.processes.status_path)
        if status is None:
            raise RuntimeUnavailable("the workerd supervisor is not running (`manage.py runworkerd`)")
        for name, entry in status["processes"].items():
            if entry["state"] != "serving":
                kill = entry.get("last_kill")
                why = f" after it {Kill(**kill).describe()}" if kill and entry["state"] == "restarting" else ""
                raise RuntimeUnavailable(f"workerd for {name} is {entry['state']}{why}")


def _started(status: dict | None) -> bool:
    """Whether the supervisor reports, and none of its processes is still on its first start."""
    return status is not None and all(entry["state"] != "starting" for entry in status["processes"].values())


def _exited_under(entry: dict | None, sent_at: float) -> CallStopped | None:
    """The process's own exit under the call, when the one serving as it was sent is gone
    (dead, or already replaced); None while it still serves: some other failure."""
    if entry is None:
        return None
    serving = entry["state"] == "serving" and entry["since"] <= sent_at and start_time(entry["pid"]) is not None
    return None if serving else CallStopped(culprit=False, reason="exited", message="exited")


def _pointed_sha(pointer: Path) -> str | None:
    try:
        return pointer.read_text().strip()
    except FileNotFoundError:
        return None
