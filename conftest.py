"""Session-wide fixtures: workerd and Redis (their addresses come from testsupport.environment)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def workerd_host():
    """One workerd running the loader host for the whole session (per xdist worker)."""
    from django.conf import settings

    from capabilities.workerd import WorkerdHost

    host = WorkerdHost(
        binary=settings.SIGIL_WORKERD_BIN,
        port=settings.SIGIL_WORKERD_PORT,
        code_dir=settings.SIGIL_CODE_DIR,
        state_dir=settings.VAR_DIR / "workerd",
        secret=settings.SIGIL_INTERNAL_SECRET,
    )
    host.start()
    yield host
    host.stop()


@pytest.fixture
def redis_client():
    """The Redis Sigil uses, emptied before each test."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.close()
