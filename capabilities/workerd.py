"""The workerd process that runs the loader host: its config, start, stop and supervision."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

HOST_DIR = Path(__file__).resolve().parent / "runtimes" / "host"
COMPATIBILITY_DATE = "2025-01-01"


class WorkerdMissing(RuntimeError):
    """The workerd binary is not installed where the settings say."""


def _capnp_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.state_dir / f"workerd-{self.port}.capnp"

    def write_config(self) -> Path:
        """Write the capnp config; the host module is copied beside it so `embed` finds it."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.code_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HOST_DIR / "host.js", self.state_dir / "host.js")
        config = f"""using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  services = [
    (name = "host", worker = .host),
    (name = "code", disk = (path = {_capnp_string(str(self.code_dir.resolve()))}, writable = false)),
  ],
  sockets = [
    (name = "http", address = "127.0.0.1:{self.port}", http = (), service = "host"),
  ],
);

const host :Workerd.Worker = (
  modules = [(name = "host.js", esModule = embed "host.js")],
  compatibilityDate = "{COMPATIBILITY_DATE}",
  compatibilityFlags = ["experimental", "nodejs_compat"],
  bindings = [
    (name = "LOADER", workerLoader = (id = "capabilities")),
    (name = "CODE", service = "code"),
    (name = "SIGIL_SECRET", fromEnvironment = "SIGIL_INTERNAL_SECRET"),
  ],
);
"""
        self.config_path.write_text(config)
        return self.config_path

    def start(self, *, wait_seconds: float = 15.0) -> None:
        """Start workerd and wait until its socket accepts connections.

        Raises WorkerdMissing when the binary is absent, RuntimeError when it does not come up.
        """
        if not Path(self.binary).exists():
            raise WorkerdMissing(
                f"workerd not found at {self.binary}: run `npm ci` (or `make install`) "
                "in the project directory, or set SIGIL_WORKERD_BIN"
            )
        self.write_config()
        env = {**os.environ, "SIGIL_INTERNAL_SECRET": self.secret}
        log = open(self.state_dir / f"workerd-{self.port}.log", "ab")
        self.process = subprocess.Popen(
            [self.binary, "serve", str(self.config_path), "--experimental"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + wait_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"workerd exited with {self.process.returncode}; see {self.state_dir}/workerd-{self.port}.log"
                )
            if port_is_open(self.port):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"workerd did not listen on port {self.port} within {wait_seconds} s")

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def supervise(self, stop_event: threading.Event, *, poll_seconds: float = 0.2) -> None:
        """Keep workerd running until `stop_event` is set, restarting it when it dies."""
        backoff = 0.2
        while not stop_event.is_set():
            if not self.is_running():
                code = self.process.returncode if self.process else None
                if self.process is not None:
                    logger.warning("workerd exited with %s; restarting", code)
                try:
                    self.start()
                    backoff = 0.2
                except RuntimeError:
                    logger.exception("workerd failed to start; retrying in %.1f s", backoff)
                    stop_event.wait(backoff)
                    backoff = min(backoff * 2, 10.0)
                    continue
            stop_event.wait(poll_seconds)
        self.stop()


def port_is_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
