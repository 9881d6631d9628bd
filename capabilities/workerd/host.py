"""A workerd process that runs the loader host: start, stop, its output, and simple
supervision (capabilities.workerd.supervision adds the watchdog, .group a process per name)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from capabilities.workerd.config import HOST_DIR, HOST_MODULES, loader_host_config
from capabilities.workerd.secrets import StoredSecrets
from sigil.lifetime import PidFiles, die_with_parent
from sigil.ports import port_is_open, wait_for_port_closed
from sigil.restarts import keep_running

logger = logging.getLogger(__name__)


class WorkerdMissing(RuntimeError):
    """The workerd binary is not installed where the settings say."""

    permanent = True  # no restart can fix it (sigil.restarts gives up at once)


class WorkerdPortInUse(RuntimeError):
    """Another process listens on the port workerd should take."""


#: what workerd prints (its warnings, a capability's uncaught errors), relayed into Sigil's log
output_logger = logging.getLogger("capabilities.workerd.output")


def _relay_output(process: subprocess.Popen, log_path: Path, port: int, secrets: StoredSecrets) -> None:
    """Copy each line workerd prints to its log file and to Sigil's log, until it exits, with
    the secret values of the code it runs masked first (a capability's console.log of one).
    Read on whatever happens, or workerd would block on a full pipe."""
    with open(log_path, "ab") as log:
        for raw in process.stdout:
            line = secrets.mask(raw.decode(errors="replace"))
            log.write(line.encode())
            log.flush()
            line = line.rstrip()
            # workerd marks its own notes that call for no action NOSENTRY (one per new isolate).
            level = logging.DEBUG if "NOSENTRY" in line else logging.INFO
            output_logger.log(level, "%s", line, extra={"workerd_port": port})
    process.stdout.close()


@dataclass
class WorkerdHost:
    """One workerd process serving the loader host on 127.0.0.1:`port`.

    Code bundles are read from `code_dir` (`{sha}.json`); the shared secret is handed to
    workerd through its environment, never written into the config file.
    """

    binary: str
    port: int
    code_dir: Path
    state_dir: Path
    secret: str
    #: False keeps workerd in the caller's process group, so that whatever stops the caller's
    #: group (runsigil, a service manager) stops workerd too even if the caller was killed.
    own_session: bool = True
    #: where the host posts the calls' records (capabilities.log_sink.LogSink); None: none kept
    log_sink_port: int | None = None
    #: the per-call bounds the host applies to a record: {"lines": …, "lineBytes": …}
    log_limits: dict | None = None
    #: what its Workers' `fetch()` may reach beyond the public internet (config.loader_host_config)
    outbound_allow: tuple[str, ...] | None = None
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_settings(cls, **overrides) -> WorkerdHost:
        """The workerd of the local runtime, as Sigil's settings describe it."""
        from django.conf import settings

        return cls(
            **{
                "binary": settings.SIGIL_WORKERD_BIN,
                "port": settings.SIGIL_WORKERD_PORT,
                "code_dir": settings.SIGIL_CODE_DIR,
                "state_dir": settings.VAR_DIR / "workerd",
                "secret": settings.SIGIL_INTERNAL_SECRET,
                **overrides,
            }
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.state_dir / f"workerd-{self.port}.capnp"

    @property
    def log_path(self) -> Path:
        return self.state_dir / f"workerd-{self.port}.log"

    @property
    def pid_name(self) -> str:
        """Its pid file's name in `state_dir` (sigil.lifetime.PidFiles)."""
        return f"workerd-{self.port}"

    def write_config(self) -> Path:
        """Write the capnp config; the host's modules are copied beside it so `embed` finds them."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.code_dir.mkdir(parents=True, exist_ok=True)
        for module in HOST_MODULES:
            shutil.copyfile(HOST_DIR / module, self.state_dir / module)
        config = loader_host_config(
            port=self.port,
            code_dir=self.code_dir,
            log_sink_port=self.log_sink_port,
            log_limits=self.log_limits,
            outbound_allow=self.outbound_allow,
        )
        self.config_path.write_text(config)
        return self.config_path

    def environment(self) -> dict[str, str]:
        """What workerd's environment adds for the config's `fromEnvironment` bindings."""
        return {"SIGIL_INTERNAL_SECRET": self.secret}

    def start(self, *, wait_seconds: float = 15.0, port_wait_seconds: float = 5.0) -> None:
        """Start workerd and wait until it listens on its port. Starting a host whose workerd
        runs does nothing (`supervise` after a `start`, as the emulator's command does).

        Raises WorkerdMissing when the binary is absent, WorkerdPortInUse when another process
        still holds the port after `port_wait_seconds`, RuntimeError when workerd exits or does
        not listen within `wait_seconds`.
        """
        if self.is_running():
            return
        if not Path(self.binary).exists():
            raise WorkerdMissing(
                f"workerd not found at {self.binary}: run `npm ci` (or `make install`) "
                "in the project directory, or set SIGIL_WORKERD_BIN"
            )
        # One that a killed run left here (the instant between its fork and its parent-death
        # signal, or an older Sigil's) is ended first.
        pid_files = PidFiles(self.state_dir)
        if pid_files.end_leftover(self.pid_name):
            logger.warning("ended the workerd a previous run left on port %s", self.port)
        # A workerd that is still dying (or another program) holds the port; the new one
        # would fail to bind while "port open" made it look started.
        if not wait_for_port_closed(self.port, port_wait_seconds):
            raise WorkerdPortInUse(
                f"port {self.port} on 127.0.0.1 is held by another process: stop it or set SIGIL_WORKERD_PORT"
            )
        self.write_config()
        env = {**os.environ, **self.environment()}
        self.process = subprocess.Popen(
            [self.binary, "serve", str(self.config_path), "--experimental"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=self.own_session,
            # Whatever ends the process that started it (a kill -9 too) ends workerd, which
            # keeps nothing worth a graceful stop. Started from the supervising thread, which
            # lives as long as the process it starts.
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
        pid_files.record(self.pid_name, self.process.pid)
        threading.Thread(
            target=_relay_output,
            args=(self.process, self.log_path, self.port, StoredSecrets(code_dir=self.code_dir, seal_key=self.secret)),
            name="workerd-output",
            daemon=True,
        ).start()
        deadline = time.monotonic() + wait_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"workerd exited with {self.process.returncode}; see {self.log_path}")
            if port_is_open(self.port):
                logger.info("workerd (pid %s) serving on %s", self.process.pid, self.url)
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"workerd did not listen on port {self.port} within {wait_seconds} s; see {self.log_path}")

    def stop(self, *, timeout: float = 5.0) -> None:
        """Stop workerd: SIGTERM, then SIGKILL after `timeout`. Stopping a stopped host does nothing."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        PidFiles(self.state_dir).forget(self.pid_name)
        self.process = None

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def supervise(self, stop_event: threading.Event, *, poll_seconds: float = 0.1) -> None:
        """Keep workerd running until `stop_event` is set, restarting it when it dies (as
        sigil.restarts says when); then stop it. A workerd already running (started by
        `start()`, so that a caller learns at once that it cannot start) is watched, not
        started a second time beside itself. Raises WorkerdMissing at once: no restart can
        fix it. Call it from a thread other than the one handling signals;
        `stop_event.set()` from a signal handler can deadlock with an `Event.wait()` on the
        same thread.
        """

        def start() -> None:
            if not self.is_running():
                self.start()

        def watch() -> bool:
            while self.is_running() and not stop_event.wait(poll_seconds):
                pass
            return False

        def exited(ran: float) -> str:
            process, self.process = self.process, None
            return f"(pid {process.pid}) exited with {process.returncode} after {ran:.1f} s"

        def failed(error: RuntimeError) -> None:
            self.process = None

        try:
            keep_running(stop_event, what="workerd", start=start, watch=watch, on_failed_start=failed, on_exit=exited)
        finally:
            self.stop()
