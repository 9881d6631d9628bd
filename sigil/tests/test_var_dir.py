"""What Sigil writes under SIGIL_VAR_DIR is its owner's only, and the bundled Redis keeps
what it was told there across a stop and a kill -9."""

import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import redis
from django.conf import settings

from sigil.embedded_redis import EmbeddedRedis
from testsupport.cast import wait_for

MANAGE = str(settings.BASE_DIR / "manage.py")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_private(root: Path) -> None:
    """Every directory under `root` 0700, every file 0600 (sockets aside, which are not read)."""
    found = []
    for path in [root, *root.rglob("*")]:
        if path.is_symlink() or path.is_socket():
            continue
        expected = 0o700 if path.is_dir() else 0o600
        found.append(path)
        assert mode(path) == expected, f"{path} is {oct(mode(path))}"
    assert found


@pytest.fixture
def var_dir():
    # Short, because the Redis socket's path must fit in a unix socket address.
    path = Path(tempfile.mkdtemp(prefix="sigil-var-")) / "var"
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


def manage(var_dir: Path, *args: str, umask: int = 0o022) -> None:
    env = {**os.environ, "SIGIL_VAR_DIR": str(var_dir)}
    for inherited in ("DATABASE_URL", "SECRET_KEY", "SECRET_KEY_FILE", "SIGIL_CODE_DIR"):
        env.pop(inherited, None)
    # As a shell with the usual umask would start it.
    subprocess.run(
        [sys.executable, MANAGE, *args], env=env, check=True, capture_output=True, preexec_fn=lambda: os.umask(umask)
    )


def test_the_database_its_wal_and_the_key_are_created_owner_only(var_dir):
    manage(var_dir, "migrate", "--noinput")
    database = var_dir / "sigil.sqlite3"
    with sqlite3.connect(database) as connection:  # as Sigil's processes do: WAL, left open
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("CREATE TABLE probe (x)")
        assert (var_dir / "sigil.sqlite3-wal").exists()
        assert_private(var_dir)
    assert {p.name for p in var_dir.iterdir()} >= {"sigil.sqlite3", "secret_key"}


def test_a_var_directory_an_older_sigil_left_open_is_made_owner_only(var_dir):
    var_dir.mkdir(mode=0o755)
    for name in ("secret_key", "sigil.sqlite3"):
        (var_dir / name).write_text("x" if name == "secret_key" else "")
        (var_dir / name).chmod(0o644)
    var_dir.chmod(0o755)
    manage(var_dir, "check")
    assert mode(var_dir) == 0o700
    assert mode(var_dir / "secret_key") == mode(var_dir / "sigil.sqlite3") == 0o600


@pytest.fixture
def durable_redis(var_dir):
    server = EmbeddedRedis(var_dir / "redis")
    server.start()
    yield server
    server.stop()


def client(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis(unix_socket_path=str(server.socket_path), socket_timeout=5)


def write_some(server: EmbeddedRedis, prefix: str) -> dict[bytes, bytes]:
    keys = {f"{prefix}:{i}".encode(): f"value {i}".encode() for i in range(200)}
    connection = client(server)
    # While a sync of the file is still running on a slow disk, Redis holds back its next
    # writes to the file (up to 2 s) and answers meanwhile (sigil/embedded_redis.py): the
    # writes are made once no sync is running, in one transaction, so they go out together.
    wait_for(
        lambda: connection.info("persistence")["aof_pending_bio_fsync"] == 0, message="no sync of the file running"
    )
    with connection.pipeline(transaction=True) as batch:
        batch.mset(keys)
        batch.rpush(f"{prefix}:queue".encode(), b"a task")
        batch.incrby(f"{prefix}:counter".encode(), 7)
        batch.execute()
    connection.close()
    return keys


def assert_kept(server: EmbeddedRedis, prefix: str, keys: dict[bytes, bytes]) -> None:
    connection = client(server)
    assert connection.mget(list(keys)) == list(keys.values())
    assert connection.lrange(f"{prefix}:queue".encode(), 0, -1) == [b"a task"]
    assert connection.get(f"{prefix}:counter".encode()) == b"7"
    connection.close()


def test_the_bundled_redis_keeps_what_it_was_told_across_a_stop(durable_redis):
    keys = write_some(durable_redis, "stopped")
    durable_redis.stop()
    durable_redis.start()
    assert_kept(durable_redis, "stopped", keys)


def test_the_bundled_redis_keeps_what_it_acknowledged_across_a_kill_9(durable_redis):
    keys = write_some(durable_redis, "killed")
    # At once: a write is in the append-only file before Redis answers it.
    os.kill(durable_redis.process.pid, signal.SIGKILL)
    durable_redis.process.wait()
    durable_redis.start()
    assert_kept(durable_redis, "killed", keys)


def test_the_bundled_redis_files_are_owner_only(durable_redis):
    write_some(durable_redis, "modes")
    client(durable_redis).bgrewriteaof()
    assert any(durable_redis.directory.glob("*.aof"))
    assert_private(durable_redis.directory)
