"""The placement lock: one placement, page-out, move or removal of a capability at a time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from django.conf import settings

from sigil import leases, redis_keys
from sigil.errors import Timeout
from sigil.redis_client import get_redis


class PlacementUnderWay(Exception):
    """Another call or process holds the capability's placement lock (a caller that asked not
    to wait for it watches the route instead: the engine)."""


class Lock(Protocol):
    def acquire(self) -> bool: ...

    def release(self) -> None: ...


@contextmanager
def held(lock: Lock, *, busy: Exception) -> Iterator[None]:
    """Hold `lock` for the block; raise `busy` when it cannot be acquired."""
    if not lock.acquire():
        raise busy
    try:
        yield
    finally:
        lock.release()


def placement_lock(full: str, *, blocking: bool, wait_seconds: float | None = None) -> leases.Lease:
    """The lock held while `full` is placed, paged, moved or removed: one at a time.

    A lease (sigil/leases.py): held up to SIGIL_PLACEMENT_LOCK_SECONDS while its
    process lives, free within SIGIL_LEASE_SECONDS of its death. A blocking caller waits up
    to SIGIL_PLACEMENT_LOCK_SECONDS, or `wait_seconds` when given.
    """
    seconds = settings.SIGIL_PLACEMENT_LOCK_SECONDS
    return leases.Lease(
        redis_keys.place_lock(full),
        hold_seconds=seconds,
        blocking=blocking,
        blocking_timeout=seconds if wait_seconds is None else wait_seconds,
    )


def placement_in_progress(full: str) -> bool:
    return bool(get_redis().exists(redis_keys.place_lock(full)))


def placement_lock_within(full: str, *, wait_seconds: float | None):
    """Hold `full`'s placement lock (a context manager), waiting at most `wait_seconds`
    (None: the lock's timeout; 0: not at all).

    Raises Timeout when another placement still holds it then: a caller waiting on a page-in
    gives up when its call would have (SIGIL_INVOKE_TIMEOUT_SECONDS), not after the lock's
    far longer timeout. With 0, raises PlacementUnderWay at once instead.
    """
    if wait_seconds == 0:
        return held(placement_lock(full, blocking=False), busy=PlacementUnderWay(full))
    waited = wait_seconds or settings.SIGIL_PLACEMENT_LOCK_SECONDS
    busy = Timeout(f"{full} is still being placed after {waited:g} s; try again shortly")
    return held(placement_lock(full, blocking=True, wait_seconds=waited), busy=busy)
