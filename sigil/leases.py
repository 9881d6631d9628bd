"""Marks in Redis that belong to a live process: leases its holder renews while it works, and
each process's own liveness key.

A mark taken with a fixed timeout outlives a process killed while holding it by the whole
timeout (the placement lock's was 180 s, so a host's death held up its page-ins for three
minutes). A lease is short (SIGIL_LEASE_SECONDS) and renewed every third of that by one
thread per process, for as long as its holder keeps it, up to the longest hold it may need;
a process that dies stops renewing, so whatever it held is free within one lease, and the
next process takes it over. The same thread keeps the process's liveness key
(`redis_keys.process`), which marks held per process (the pager's in-flight counts) are judged by.

Cost: one thread per process, one Redis call per lease held and one for the liveness key
every third of a lease.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time

from django.conf import settings
from redis.exceptions import LockError, RedisError
from redis.lock import Lock

from sigil import redis_keys
from sigil.redis_client import get_redis

logger = logging.getLogger(__name__)


def lease_seconds() -> float:
    """How long a mark outlives the process that stopped renewing it."""
    return float(settings.SIGIL_LEASE_SECONDS)


class Lease(Lock):
    """A Redis lock its process renews while it is held, for at most `hold_seconds` in all.

    Its key expires `min(SIGIL_LEASE_SECONDS, hold_seconds)` after the last renewal: after a
    holder's death, or once it has held the lock `hold_seconds` (a holder that hangs does not
    hold it for good). Used as redis-py's Lock is (`acquire`, `release`, `with`); its token
    is shared by the process's threads, so the renewing thread can extend it.
    """

    def __init__(
        self, name: str, *, hold_seconds: float, blocking: bool = True, blocking_timeout: float | None = None
    ) -> None:
        super().__init__(
            get_redis(),
            name,
            timeout=min(lease_seconds(), hold_seconds),
            blocking=blocking,
            blocking_timeout=blocking_timeout,
            thread_local=False,
        )
        self.hold_seconds = hold_seconds
        self.held_until = 0.0

    def acquire(self, *args, **kwargs) -> bool:
        acquired = super().acquire(*args, **kwargs)
        if acquired:
            self.held_until = time.monotonic() + self.hold_seconds
            _RENEWER.hold(self)
        return acquired

    def release(self) -> None:
        _RENEWER.drop(self)
        super().release()

    def renew(self) -> bool:
        """Extend the key to a full lease again; False once the lease is no longer this
        holder's to renew (held `hold_seconds`, expired or taken over, released)."""
        if time.monotonic() >= self.held_until:
            return False
        try:
            return bool(self.reacquire())
        except LockError:
            return False


class _Renewer:
    """The process's renewing thread: every third of a lease it renews every lease held and
    the process's liveness key. Started on first use, and again in a forked child (which
    holds none of its parent's leases and is a process of its own)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._pid: int | None = None
        self._held: dict[int, Lease] = {}
        self._process = ""

    def forked(self) -> None:
        """In a forked child: the guard may have been held by the parent's thread."""
        self._guard = threading.Lock()

    def _ensure(self) -> None:
        """With the guard held: the thread runs for this process."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._held = {}
        self._process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._beat()
        threading.Thread(target=self._run, args=(self._pid,), name="sigil lease renewer", daemon=True).start()

    def process(self) -> str:
        with self._guard:
            self._ensure()
            return self._process

    def hold(self, lease: Lease) -> None:
        with self._guard:
            self._ensure()
            self._held[id(lease)] = lease

    def drop(self, lease: Lease) -> None:
        with self._guard:
            self._held.pop(id(lease), None)

    def _beat(self) -> None:
        try:
            get_redis().set(redis_keys.process(self._process), 1, px=int(lease_seconds() * 1000))
        except RedisError as exc:
            logger.warning("could not mark this process live: %s", exc)

    def _run(self, pid: int) -> None:
        while True:
            time.sleep(lease_seconds() / 3)
            with self._guard:
                if self._pid != pid:
                    return  # a forked child's copy of the thread's state: not ours
                held = list(self._held.values())
            self._beat()
            for lease in held:
                try:
                    renewed = lease.renew()
                except RedisError as exc:
                    logger.warning("could not renew %s: %s", lease.name, exc)
                    continue
                if not renewed:
                    self.drop(lease)


_RENEWER = _Renewer()
os.register_at_fork(after_in_child=_RENEWER.forked)


def this_process() -> str:
    """This process's id among the hosts' processes; it is live while its key is
    (`redis_keys.process`), renewed every third of a lease."""
    return _RENEWER.process()


def mark_live(pipe) -> str:
    """Queue on `pipe` the renewal of this process's liveness key (so a count taken with it
    counts at once, even just after Redis lost the key); return the process's id."""
    process = this_process()
    pipe.set(redis_keys.process(process), 1, px=int(lease_seconds() * 1000))
    return process


def processes_live(processes: list[str]) -> dict[str, bool]:
    """Which of `processes` are live: one Redis round trip."""
    if not processes:
        return {}
    pipe = get_redis().pipeline(transaction=False)
    for process in processes:
        pipe.exists(redis_keys.process(process))
    return {process: bool(live) for process, live in zip(processes, pipe.execute(), strict=True)}
