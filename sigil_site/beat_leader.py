"""One beat sends, however many run: a lease in the Redis every host shares.

Every Celery beat (`celery -A sigil_site beat` on a production host, the one `make run`
embeds in its worker) runs this scheduler; only the one holding the lease (a
`sigil.leases.Lease`, renewed by its process every third of SIGIL_LEASE_SECONDS)
sends periodic tasks. When that host dies its lease runs out within SIGIL_LEASE_SECONDS and
the next beat to tick takes it, so two hosts never send the schedule twice and a lost
host's schedule does not stop.

Cost: one Redis call per tick (at least every third of a lease), besides the renewal.
"""

from __future__ import annotations

import contextlib
import logging

from celery.beat import PersistentScheduler
from redis.exceptions import LockError, RedisError

from sigil import redis_keys
from sigil.leases import Lease, lease_seconds

logger = logging.getLogger(__name__)


class LeasedScheduler(PersistentScheduler):
    """Celery's file-backed scheduler, sending only while this beat holds the lease."""

    def __init__(self, *args, **kwargs) -> None:
        # Held for as long as this beat runs; a beat that hangs stops its process's renewals
        # no more than a dead one does, so the schedule moves on either way.
        self.lease = Lease(redis_keys.BEAT_LEADER, hold_seconds=float("inf"), blocking=False)
        self.leading = False
        super().__init__(*args, **kwargs)

    def hold_lease(self) -> bool:
        """Keep or take the lease; False when another beat holds it or Redis cannot say."""
        try:
            held = self.lease.owned() if self.leading else False
            held = held or self.lease.acquire(blocking=False)
        except RedisError as exc:
            logger.warning("beat cannot reach Redis to hold its lease (%s); sending nothing", exc)
            held = False
        if held != self.leading:
            logger.info("this beat %s the schedule", "sends" if held else "no longer sends")
            self.leading = held
        return held

    def tick(self, *args, **kwargs) -> float:
        again_in = lease_seconds() / 3
        if not self.hold_lease():
            return again_in
        return min(super().tick(*args, **kwargs), again_in)

    def close(self) -> None:
        super().close()
        if self.leading:  # let another host's beat take over at once
            with contextlib.suppress(LockError, RedisError):  # it runs out on its own then
                self.lease.release()
            self.leading = False
