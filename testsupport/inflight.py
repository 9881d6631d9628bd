"""Requests the test server is still answering.

The engine records a call (counters, a breaker change and the task that persists it) after
the caller has the last byte. A test can end in between; its teardown waits for these requests
before it checks the Celery worker is idle, so that no task is queued after that check, while
the database is being emptied.
"""

from __future__ import annotations

import threading
import time


class RequestsInFlight:
    """An ASGI wrapper counting HTTP requests from their start until the application is done
    with them (the call recorded)."""

    def __init__(self, app) -> None:
        self.app = app
        self._count = 0
        self._lock = threading.Lock()

    def _add(self, delta: int) -> None:
        with self._lock:
            self._count += delta

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        self._add(1)
        try:
            return await self.app(scope, receive, send)
        finally:
            self._add(-1)

    def wait_idle(self, timeout: float) -> bool:
        """Whether every request was done within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self._count:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


#: The session's test server, once started (one per test process).
SERVER_REQUESTS: list[RequestsInFlight] = []
