"""One beat sends, however many run: a lease in the Redis every host shares.

Every Celery beat (`celery -A sigil_site beat` on a production host, the one `make run`
embeds in its worker) runs this scheduler; only the one holding the lease sends periodic
tasks, and it renews the lease at a third of its length. When that host dies its lease
runs out within LEASE_SECONDS and the next beat to tick takes it, so two hosts never send
the same schedule twice and a lost host's schedule does not stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid

import redis
from celery.beat import PersistentScheduler

from sigil_site.redis_client import get_redis

logger = logging.getLogger(__name__)

LEASE_KEY = "sigil:beat:leader"
LEASE_SECONDS = 30
# Take the lease when free, or renew it when this beat holds it; 1 when held afterwards.
_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeasedScheduler(PersistentScheduler):
    """Celery's file-backed scheduler, sending only while this beat holds the lease."""

    def __init__(self, *args, **kwargs) -> None:
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.leading = False
        super().__init__(*args, **kwargs)

    def hold_lease(self) -> bool:
        """Take or renew the lease; False when another beat holds it or Redis cannot say."""
        try:
            held = bool(get_redis().eval(_HOLD, 1, LEASE_KEY, self.holder, LEASE_SECONDS * 1000))
        except redis.RedisError as exc:
            logger.warning("beat cannot reach Redis to hold its lease (%s); sending nothing", exc)
            held = False
        if held != self.leading:
            logger.info("beat %s %s the schedule", self.holder, "sends" if held else "no longer sends")
            self.leading = held
        return held

    def tick(self, *args, **kwargs) -> float:
        renew_in = LEASE_SECONDS / 3
        if not self.hold_lease():
            return renew_in
        return min(super().tick(*args, **kwargs), renew_in)

    def close(self) -> None:
        super().close()
        if self.leading:  # let another host's beat take over at once
            with contextlib.suppress(redis.RedisError):  # it runs out on its own then
                get_redis().eval(_RELEASE, 1, LEASE_KEY, self.holder)
            self.leading = False
