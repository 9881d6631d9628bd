"""Dynamic Workers, each in a workerd process of its own, as each has an isolate of its own on
Cloudflare.

A Worker Loader's Dynamic Worker that spins is stopped at its CPU limit on Cloudflare, and no
other Dynamic Worker notices (reference §5.3). One workerd runs every isolate of a process on
one event loop; so the emulator's Worker Loader binding (`cfemulator.bound`) runs none of them
in its loader Worker's process. It hands the code `getCode` returned to the emulator once per
id (`register`), and sends each call of an entrypoint's `fetch` here, which runs it in the
Dynamic Worker's own process (a runner, `cfemulator.dynamic_host`), metered by the CPU meter
against the Dynamic Worker's limits and supervised as every script's process is: past its
limit, that process alone is stopped, and the loader Worker's `fetch()` throws Cloudflare's
"Worker exceeded CPU time limit.".

Each Dynamic Worker is known by a key: a digest of its loader Worker's process, binding, id and
code, since Cloudflare identifies a Dynamic Worker by its id and its code (reference §5.1); a
`load()` (an id of null) is a new one each time. Its code is kept until the next reset, in a
directory every runner reads through a disk service (so a load takes no round trip through
the emulator). Its process is started at its first call and stopped once no call has reached
it for `idle_seconds` (a process is about 10 MB), and started again by the next call, which
loads the code afresh, as a cold isolate on Cloudflare would. So that a first call does not wait for a
workerd to start, one spare runner, started as soon as a loader Worker is called and again
each time one is taken, waits for the next new Dynamic Worker.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import urllib3
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cfemulator.dynamic_host import WARM_UP_HEADER
from cfemulator.limits import dynamic_cpu_ms
from cfemulator.scripts import RUNNER_PREFIX, ScriptProcess, ScriptProcesses
from sigil.files import write_atomically

logger = logging.getLogger(__name__)

# How often the idle runners are looked for.
_IDLE_CHECK_SECONDS = 1.0
_WARM_UP = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5.0, read=10.0), retries=False)


class UnknownDynamicWorker(KeyError):
    """No Dynamic Worker was handed over with this key (or the emulator was reset since)."""


@dataclass(eq=False)
class DynamicWorker:
    """One Dynamic Worker as its loader Worker handed it over, and the process it runs in."""

    key: str
    #: the process name of the loader Worker (in `ScriptProcesses`), where its tail events go
    owner: str
    binding: str
    id: str | None
    #: its code's own `limits`, which the entrypoint's may lower
    limits: Any = None
    #: the runner it runs in while it has one
    process: str | None = None
    #: calls in flight to it, and when the last one ended (monotonic)
    calls: int = 0
    used_at: float = field(default_factory=time.monotonic)


def _code_of(body: bytes) -> tuple[str, str | None, dict[str, Any]]:
    """The binding, id and WorkerCode of a hand-over. Raises ValueError when it is none; what
    the code itself lacks is for workerd's loader to say, in its own words, when it loads it."""
    try:
        handed = json.loads(body)
    except ValueError as exc:
        raise ValueError("the Dynamic Worker's hand-over is not JSON") from exc
    if not isinstance(handed, dict):
        raise ValueError("the Dynamic Worker's hand-over is not a JSON object")
    binding, worker_id, code = handed.get("binding"), handed.get("id"), handed.get("code")
    if not isinstance(binding, str) or not (worker_id is None or isinstance(worker_id, str)):
        raise ValueError("a Dynamic Worker is handed over with its binding's name and its id")
    if not isinstance(code, dict) or not isinstance(code.get("modules"), dict):
        raise ValueError("a Dynamic Worker's code is an object with its `modules`")
    return binding, worker_id, code


def seal_code(encoded: bytes, *, key: bytes) -> bytes:
    """A Dynamic Worker's code file: `encoded` sealed with AES-256-GCM under `key` (the nonce
    first), as the runners open it (cfemulator.dynamic_host)."""
    nonce = os.urandom(12)
    sealed = nonce + AESGCM(key).encrypt(nonce, encoded, None)
    return json.dumps({"sealed": base64.b64encode(sealed).decode()}).encode()


class DynamicWorkers:
    """The Dynamic Workers handed over by loader Workers, by key, and their processes.

    Thread-safe. `start()` runs the thread that stops idle processes; `reset()` forgets every
    Dynamic Worker (their processes are stopped with the scripts', `ScriptProcesses.stop_all`).
    Their code is written to `scripts.dynamic_code_dir`, `{key}.json`, as the runners read it,
    sealed (`seal_code`): a Dynamic Worker's env may hold secret values.
    """

    def __init__(self, *, scripts: ScriptProcesses, idle_seconds: Callable[[], float]) -> None:
        self.scripts = scripts
        self.code_dir = scripts.dynamic_code_dir
        self._idle_seconds = idle_seconds
        self._workers: dict[str, DynamicWorker] = {}
        self._lock = threading.Lock()
        # Runner names are reused once their process stopped, so their ports are too.
        self._free_names: list[str] = []
        self._named = 0
        self._spare: str | None = None
        self._spare_since = 0.0
        self._spare_starting = False
        self._generation = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- what the loader Workers' bindings ask -------------------------------------------------

    def register(self, *, owner: str, body: bytes) -> str:
        """Keep the Dynamic Worker handed over in `body` by the loader Worker of process
        `owner`; return its key. Idempotent: the same id and code give the same key.

        Raises ValueError when the hand-over is malformed.
        """
        binding, worker_id, code = _code_of(body)
        encoded = json.dumps(code, sort_keys=True, separators=(",", ":")).encode()
        if worker_id is None:
            key = secrets.token_hex(16)  # load(), or get(null): never cached (reference §5.3)
        else:
            identity = json.dumps([owner, binding, worker_id], separators=(",", ":")).encode() + b"\n" + encoded
            key = hashlib.sha256(identity).hexdigest()[:32]
        path = self.code_dir / f"{key}.json"
        if not path.exists():
            self.code_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(path, seal_code(encoded, key=self.scripts.dynamic_code_key))
        with self._lock:
            if key not in self._workers:
                self._workers[key] = DynamicWorker(
                    key=key, owner=owner, binding=binding, id=worker_id, limits=code.get("limits")
                )
        return key

    def owner_of(self, key: str) -> str | None:
        """The process name of the loader Worker that handed over `key`; None when unknown."""
        with self._lock:
            worker = self._workers.get(key)
        return worker.owner if worker is not None else None

    def cpu_ms(self, key: str, entrypoint_limits: Any, *, default: int) -> int:
        """The CPU limit of a call to `key` through an entrypoint given `entrypoint_limits`.

        Raises UnknownDynamicWorker."""
        with self._lock:
            worker = self._workers.get(key)
        if worker is None:
            raise UnknownDynamicWorker(key)
        return dynamic_cpu_ms(worker.limits, entrypoint_limits, default=default)

    @contextlib.contextmanager
    def call(self, key: str) -> Iterator[Callable[[], ScriptProcess]]:
        """One call to the Dynamic Worker `key`, in flight for as long as the block runs (its
        process is not stopped for idleness meanwhile). Yields what returns its process,
        started (from the spare, when there is one) as needed.

        Raises UnknownDynamicWorker; the process's start raises TimeoutError or RuntimeError.
        """
        with self._lock:
            worker = self._workers.get(key)
            if worker is None:
                raise UnknownDynamicWorker(key)
            worker.calls += 1
        took_spare: list[bool] = []
        try:
            yield lambda: self._process_of(worker, took_spare)
        finally:
            with self._lock:
                worker.calls -= 1
                worker.used_at = time.monotonic()
            if took_spare:
                # Only now: a workerd starting takes a core the call would have waited for.
                self.prepare()

    def prepare(self) -> None:
        """Have a spare runner start, unless one runs or starts: a loader Worker is called, so a
        new Dynamic Worker may soon be. Returns at once."""
        with self._lock:
            if self._spare is not None or self._spare_starting:
                return
            self._spare_starting = True
            generation = self._generation
        threading.Thread(target=self._start_spare, args=(generation,), name="cfemulator-spare", daemon=True).start()

    # --- processes ------------------------------------------------------------------------------

    def _process_of(self, worker: DynamicWorker, took_spare: list[bool]) -> ScriptProcess:
        with self._lock:
            if worker.process is None:
                if self._spare is not None:
                    worker.process, self._spare = self._spare, None
                    took_spare.append(True)
                else:
                    worker.process = self._new_name_locked()
            name = worker.process
        return self.scripts.acquire_runner(name)

    def _new_name_locked(self) -> str:
        if self._free_names:
            return self._free_names.pop()
        self._named += 1
        return f"{RUNNER_PREFIX}{self._named}"

    def _start_spare(self, generation: int) -> None:
        with self._lock:
            name = self._new_name_locked()
        try:
            running = self.scripts.acquire_runner(name)
            _WARM_UP.request("GET", f"http://127.0.0.1:{running.port}/", headers={WARM_UP_HEADER: "1"})
        except (RuntimeError, TimeoutError, urllib3.exceptions.HTTPError) as exc:
            logger.warning("the spare runner for Dynamic Workers did not start: %s", exc)
            self.scripts.retire(name)
            with self._lock:
                self._spare_starting = False
                self._free_names.append(name)
            return
        with self._lock:
            current = generation == self._generation
            if current:
                self._spare, self._spare_since, self._spare_starting = name, time.monotonic(), False
        if not current:  # reset meanwhile: it belongs to no one
            self.scripts.retire(name)

    def stop_idle(self) -> list[str]:
        """Stop the processes of the Dynamic Workers no call has reached for `idle_seconds`, and
        the spare once no Dynamic Worker has a process either; return their names."""
        idle_for = self._idle_seconds()
        now = time.monotonic()
        with self._lock:
            stopping = []
            for worker in self._workers.values():
                if worker.process is not None and worker.calls == 0 and now - worker.used_at >= idle_for:
                    stopping.append(worker.process)
                    worker.process = None
            busy = any(worker.process is not None for worker in self._workers.values())
            if self._spare is not None and not busy and now - self._spare_since >= idle_for:
                stopping.append(self._spare)
                self._spare = None
            generation = self._generation
        for name in stopping:
            self.scripts.retire(name)
        with self._lock:
            if generation == self._generation:
                self._free_names.extend(stopping)
        return stopping

    # --- lifetime -------------------------------------------------------------------------------

    def start(self) -> None:
        shutil.rmtree(self.code_dir, ignore_errors=True)  # a previous run's, which nothing names
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="cfemulator-dynamic", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(min(_IDLE_CHECK_SECONDS, max(0.1, self._idle_seconds() / 2))):
            try:
                self.stop_idle()
            except Exception:  # the next look tries again; a failure here must not end the thread
                logger.exception("stopping idle Dynamic Workers failed")

    def reset(self) -> None:
        """Forget every Dynamic Worker and runner (the processes are the scripts', stopped with them)."""
        with self._lock:
            self._workers.clear()
            self._free_names.clear()
            self._named = 0
            self._spare, self._spare_starting = None, False
            self._generation += 1
        shutil.rmtree(self.code_dir, ignore_errors=True)

    def snapshot(self) -> list[dict[str, Any]]:
        """Each Dynamic Worker: its loader Worker's process, binding, id, and its process's name
        and pid while it has one (for /__emulator/dynamic-workers)."""
        with self._lock:
            workers = list(self._workers.values())
        listed = []
        for worker in workers:
            running = self.scripts.running(worker.process) if worker.process else None
            listed.append(
                {
                    "key": worker.key,
                    "owner": worker.owner,
                    "binding": worker.binding,
                    "id": worker.id,
                    "process": worker.process,
                    "pid": running.pid if running is not None else None,
                    "calls": worker.calls,
                }
            )
        return listed
