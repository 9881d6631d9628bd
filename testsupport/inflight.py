"""Requests the test server is still answering.

The gateway records a call (counters, a breaker change and the task that persists it) in
its response's close(), after the caller has the last byte. A test can end in between; its
teardown waits for these requests before it checks the Celery worker is idle, so that no
task is queued after that check, while the database is being emptied.
"""

from __future__ import annotations

import threading
import time


class RequestsInFlight:
    """A WSGI wrapper counting requests from their start until their response is closed."""

    def __init__(self, app) -> None:
        self.app = app
        self._count = 0
        self._lock = threading.Lock()

    def _add(self, delta: int) -> None:
        with self._lock:
            self._count += delta

    def __call__(self, environ, start_response):
        self._add(1)
        try:
            result = self.app(environ, start_response)
        except BaseException:
            self._add(-1)
            raise
        return _Closing(result, lambda: self._add(-1))

    def wait_idle(self, timeout: float) -> bool:
        """Whether every request was closed within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self._count:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


class _Closing:
    def __init__(self, result, done) -> None:
        self.result = result
        self.done = done

    def __iter__(self):
        return iter(self.result)

    def close(self) -> None:
        try:
            if hasattr(self.result, "close"):
                self.result.close()
        finally:
            self.done()


#: The session's test server, once started (one per test process).
SERVER_REQUESTS: list[RequestsInFlight] = []
