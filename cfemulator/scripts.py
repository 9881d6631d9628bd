"""Every script runs in a workerd process of its own, keyed by script and started on first use.

On Cloudflare each script runs in isolates of its own: one that spins or runs out of memory
is stopped (error 1102) while every other script keeps answering. One open-source workerd
runs all its Workers on one thread, so a script that spins stops everything in its process;
the emulator therefore gives each script its own process (about 10 MB of its own memory and
30 ms to start), and stops only that process when the script runs past its limits
(`cfemulator.cpumeter`). The next call starts a fresh one.

A plain script runs as a Dynamic Worker of the loader host (`capabilities/runtimes/host`),
reading its bundle from the emulator's code directory; a script with bindings only a workerd
of its own can give runs from a config generated from its upload (`cfemulator.bound`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from capabilities.workerd import WorkerdHost, free_port, port_is_open
from cfemulator.bound import bound_config, needs_own_workerd
from cfemulator.uploads import ScriptUpload

logger = logging.getLogger(__name__)

_START_SECONDS = 15


@dataclass(eq=False)
class ScriptProcess:
    """One script's running workerd."""

    key: str
    sha: str
    bound: bool
    port: int
    process: subprocess.Popen
    directory: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_running(self) -> bool:
        return self.process.poll() is None


class ScriptProcesses:
    """The running workerd of each script, by key (`script:{name}`, `ns:{namespace}:{name}`).

    `acquire` starts a script's process on first use, and again after it was stopped; a
    bound script's process is restarted when its code or bindings changed (a plain one runs
    any version: its loader ids carry the sha). Processes of scripts the account no longer
    holds are stopped at the next start. Thread-safe.
    """

    def __init__(self, *, binary: str, state_dir: Path, code_dir: Path, secret: str) -> None:
        self.binary = binary
        self.state_dir = Path(state_dir)
        self.code_dir = Path(code_dir)
        #: the loader host's shared secret, sent with every call to a plain script
        self.secret = secret
        self.emulator_port = 0  # set once the emulator's socket is bound
        self._lock = threading.Lock()
        self._running: dict[str, ScriptProcess] = {}

    def acquire(self, key: str, *, sha: str, upload: ScriptUpload, live: Callable[[], dict[str, str]]) -> ScriptProcess:
        """`key`'s running process, started (or restarted for a new `sha`) as needed.

        Before a start, `live()` (every key the account still holds, with its sha) tells
        which other processes no script needs any more; they are stopped. Raises
        RuntimeError when workerd does not come up.
        """
        bound = needs_own_workerd(upload)
        with self._lock:
            current = self._running.get(key)
            # A plain script's process runs any version; a bound one's config holds its code.
            serves = current is not None and current.bound == bound and (current.sha == sha or not bound)
            if serves and current.is_running():
                return current
            still_held = live()
            for other, running in list(self._running.items()):
                held = still_held.get(other)
                if other != key and (held is None or (running.bound and held != running.sha)):
                    self._stop(self._running.pop(other))
            if current is not None:
                self._stop(self._running.pop(key))
            started = self._start(key, sha, upload, bound)
            self._running[key] = started
            return started

    def kill(self, running: ScriptProcess) -> None:
        """Stop `running` at once (SIGKILL: a workerd spinning in a script ignores SIGTERM).
        The next call to its script starts a fresh process. Safe from any thread."""
        if running.is_running():
            running.process.kill()
        running.process.wait()
        with self._lock:
            if self._running.get(running.key) is running:
                del self._running[running.key]
        shutil.rmtree(running.directory, ignore_errors=True)

    def stop_all(self) -> None:
        with self._lock:
            for key in list(self._running):
                self._stop(self._running.pop(key))

    def count(self) -> int:
        with self._lock:
            return sum(running.is_running() for running in self._running.values())

    def _stop(self, running: ScriptProcess) -> None:
        if running.is_running():
            running.process.terminate()
            try:
                running.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                running.process.kill()
                running.process.wait()
        shutil.rmtree(running.directory, ignore_errors=True)

    def _start(self, key: str, sha: str, upload: ScriptUpload, bound: bool) -> ScriptProcess:
        directory = self.state_dir / f"{key.replace(':', '-')}-{sha[:12]}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        port = free_port()
        if bound:
            config, environment = bound_config(directory, upload, port=port, emulator_port=self.emulator_port)
            config_path = directory / "config.capnp"
            config_path.write_text(config)
        else:
            host = WorkerdHost(
                binary=self.binary, port=port, code_dir=self.code_dir, state_dir=directory, secret=self.secret
            )
            config_path = host.write_config()
            environment = {"SIGIL_INTERNAL_SECRET": self.secret}
        log_path = directory / "workerd.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [self.binary, "serve", str(config_path), "--experimental"],
                env={**os.environ, **environment},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + _START_SECONDS
        while time.monotonic() < deadline:
            if process.poll() is not None:
                output = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"workerd for {key} exited with {process.returncode}: {output}")
            if port_is_open(port):
                return ScriptProcess(key=key, sha=sha, bound=bound, port=port, process=process, directory=directory)
            time.sleep(0.01)
        process.kill()
        process.wait()
        raise RuntimeError(f"workerd for {key} did not listen within {_START_SECONDS} s")
