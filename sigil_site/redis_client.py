"""The process's Redis connection pool, shared by services, the gateway and the pager."""

from __future__ import annotations

import functools

import redis
from django.conf import settings


@functools.cache
def get_redis() -> redis.Redis:
    """One client (and so one connection pool) per process, built from REDIS_URL."""
    return redis.Redis.from_url(settings.REDIS_URL, health_check_interval=30)
