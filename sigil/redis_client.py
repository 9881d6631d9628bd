"""The process's Redis connection pool, shared by services, the engine and the pager (the keys
they name are sigil/redis_keys.py's)."""

from __future__ import annotations

import functools

import redis
from django.conf import settings

# Sigil sends no blocking command, so a Redis that has not answered in this long is hung or
# cut off: the command fails (the engine answers 503 unavailable) instead of holding the
# caller's thread for as long as the outage lasts.
SOCKET_TIMEOUT_SECONDS = 5


@functools.cache
def get_redis() -> redis.Redis:
    """One client (and so one connection pool) per process, built from REDIS_URL."""
    return redis.Redis.from_url(
        settings.REDIS_URL,
        health_check_interval=30,
        socket_timeout=SOCKET_TIMEOUT_SECONDS,
        socket_connect_timeout=SOCKET_TIMEOUT_SECONDS,
    )
