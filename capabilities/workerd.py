"""A workerd process that runs the loader host: its config, start, stop and simple supervision
(capabilities.supervision adds the watchdog and a process per name)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sigil.lifetime import PidFiles, die_with_parent

logger = logging.getLogger(__name__)

HOST_DIR = Path(__file__).resolve().parent / "runtimes" / "host"
COMPATIBILITY_DATE = "2025-01-01"
# Every V8 collection a full one. Each request leaves native objects (its Request, Response,
# headers, I/O state) behind JS wrappers that only a full collection frees; workerd turns off
# incremental marking and, open-source, sets no heap limit, and the JS heaps stay small, so a
# full collection hardly ever came and the native memory piled up: about 13 KB per call
# through the loader host, hundreds of MB within minutes (bench/workerd_memory.py). A full
# collection of a Worker's small heap costs about what the scavenge it replaces does.
V8_FLAGS = ("--gc-global",)


class WorkerdMissing(RuntimeError):
    """The workerd binary is not installed where the settings say."""

    permanent = True  # no restart can fix it (see capabilities.supervision)


class WorkerdPortInUse(RuntimeError):
    """Another process listens on the port workerd should take."""


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one step: workerd may read a code bundle (or a slot's
    pointer) at any moment, and must never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def supervise_until_signalled(supervise: Callable[[threading.Event], None], *, name: str) -> None:
    """Run `supervise(stop)` until SIGINT or SIGTERM sets `stop`; re-raise what it raised.

    It runs in its own thread so that the signal handlers, which run on the main thread,
    never wait on a lock that thread holds.
    """
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            supervise(stop)
        except BaseException as exc:  # handed to the main thread, which raises it
            failure.append(exc)

    thread = threading.Thread(target=run, name=name)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if failure:
        raise failure[0]


def _capnp_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: what workerd prints (its warnings, a capability's uncaught errors), relayed into Sigil's log
output_logger = logging.getLogger("capabilities.workerd.output")


def _relay_output(process: subprocess.Popen, log_path: Path, port: int) -> None:
    """Copy each line workerd prints to its log file and to Sigil's log, until it exits.
    Read on whatever happens, or workerd would block on a full pipe."""
    with open(log_path, "ab") as log:
        for raw in process.stdout:
            log.write(raw)
            log.flush()
            line = raw.decode(errors="replace").rstrip()
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
    #: where the host posts the calls' records (capabilities.call_logs.LogSink); None: none kept
    log_sink_port: int | None = None
    #: the per-call bounds the host applies to a record: {"lines": …, "lineBytes": …}
    log_limits: dict | None = None
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
        """Write the capnp config; the host module is copied beside it so `embed` finds it."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.code_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HOST_DIR / "host.js", self.state_dir / "host.js")
        sink_service, sink_bindings = "", ""
        if self.log_sink_port is not None:
            sink_service = f"""
    (name = "logs", external = (address = "127.0.0.1:{self.log_sink_port}", http = ())),"""
            limits = json.dumps(self.log_limits or {})
            sink_bindings = f"""
    (name = "LOG_SINK", service = "logs"),
    (name = "LOG_LIMITS", text = {_capnp_string(limits)}),"""
        config = f"""using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  v8Flags = [{", ".join(_capnp_string(flag) for flag in V8_FLAGS)}],
  services = [
    (name = "host", worker = .host),
    (name = "code", disk = (path = {_capnp_string(str(self.code_dir.resolve()))}, writable = false)),{sink_service}
  ],
  sockets = [
    (name = "http", address = "127.0.0.1:{self.port}", http = (), service = "host"),
  ],
);

const host :Workerd.Worker = (
  modules = [(name = "host.js", esModule = embed "host.js")],
  compatibilityDate = "{COMPATIBILITY_DATE}",
  # enable_ctx_exports: the host hands each capability its own SigilTail entrypoint as its tail.
  compatibilityFlags = ["experimental", "nodejs_compat", "enable_ctx_exports"],
  bindings = [
    (name = "LOADER", workerLoader = (id = "capabilities")),
    (name = "CODE", service = "code"),
    (name = "SIGIL_SECRET", fromEnvironment = "SIGIL_INTERNAL_SECRET"),{sink_bindings}
  ],
);
"""
        self.config_path.write_text(config)
        return self.config_path

    def environment(self) -> dict[str, str]:
        """What workerd's environment adds for the config's `fromEnvironment` bindings."""
        return {"SIGIL_INTERNAL_SECRET": self.secret}

    def start(self, *, wait_seconds: float = 15.0, port_wait_seconds: float = 5.0) -> None:
        """Start workerd and wait until it listens on its port.

        Raises WorkerdMissing when the binary is absent, WorkerdPortInUse when another process
        still holds the port after `port_wait_seconds`, RuntimeError when workerd exits or does
        not listen within `wait_seconds`.
        """
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
            target=_relay_output, args=(self.process, self.log_path, self.port), name="workerd-output", daemon=True
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

    def supervise(
        self,
        stop_event: threading.Event,
        *,
        poll_seconds: float = 0.1,
        stable_seconds: float = 10.0,
        max_backoff_seconds: float = 10.0,
    ) -> None:
        """Keep workerd running until `stop_event` is set, restarting it when it dies; then stop it.

        A workerd that ran for `stable_seconds` is restarted at once; one that dies sooner, or
        fails to start, is retried after a delay that doubles up to `max_backoff_seconds`, so
        a crash loop does not spin. Raises WorkerdMissing at once: no restart can fix it.
        Call it from a thread other than the one handling signals; `stop_event.set()` from a
        signal handler can deadlock with an `Event.wait()` on the same thread.
        """
        backoff = 0.0
        started_at = 0.0
        try:
            while not stop_event.is_set():
                if self.is_running():
                    stop_event.wait(poll_seconds)
                    continue
                if self.process is not None:
                    ran = time.monotonic() - started_at
                    backoff = 0.0 if ran >= stable_seconds else _next_backoff(backoff, max_backoff_seconds)
                    logger.warning(
                        "workerd (pid %s) exited with %s after %.1f s; restarting in %.1f s",
                        self.process.pid,
                        self.process.returncode,
                        ran,
                        backoff,
                    )
                    self.process = None
                if backoff and stop_event.wait(backoff):
                    break
                try:
                    self.start()
                except WorkerdMissing:
                    raise
                except RuntimeError as exc:
                    backoff = _next_backoff(backoff, max_backoff_seconds)
                    logger.error("workerd did not start: %s; retrying in %.1f s", exc, backoff)
                    self.process = None
                    continue
                started_at = time.monotonic()
        finally:
            self.stop()


def _next_backoff(current: float, ceiling: float) -> float:
    return min(max(current * 2, 0.2), ceiling)


def wait_for_port_closed(port: int, seconds: float) -> bool:
    """Whether nothing listens on 127.0.0.1:`port`, waiting up to `seconds` for it to be released."""
    deadline = time.monotonic() + seconds
    while port_is_open(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def port_is_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_block(count: int = 16) -> int:
    """The first of `count` consecutive ports of 127.0.0.1 that are free now, below the
    kernel's ephemeral range (from 32768): ports there are handed out to outgoing
    connections at any moment, so a block of them picked now may be taken before use."""
    while True:
        base = random.randrange(20_000, 32_768 - count, count)
        if all(_can_bind(port) for port in range(base, base + count)):
            return base


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
