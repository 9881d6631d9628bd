"""Calls made over and over in a thread while a test does something else beside them."""

from __future__ import annotations

import threading
import time

import requests


class SteadyCalls:
    """GETs `url` with `headers` (or POSTs `body`, when given) over and over in a thread while
    its `with` block lasts, keeping every (status, body) in `answers` and, in `timings`, when
    each was sent (`time.monotonic()`) and how many seconds it took to be answered.

    With `per_second`, a call is sent every 1/`per_second` s (or as soon as the one before is
    answered, when it took longer), as ordinary traffic comes; without, one after another."""

    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str],
        body: bytes | None = None,
        join_timeout: float = 60,
        per_second: float | None = None,
    ) -> None:
        self.url, self.headers, self.body, self.join_timeout = url, headers, body, join_timeout
        self.interval = 1 / per_second if per_second else 0.0
        self.answers: list[tuple[int, str]] = []
        self.timings: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        session = requests.Session()  # its own: the test thread's is not shared
        method = "GET" if self.body is None else "POST"
        due = time.monotonic()
        while not self._stop.is_set():
            sent = time.monotonic()
            response = session.request(method, self.url, headers=self.headers, data=self.body, timeout=30)
            self.timings.append((sent, time.monotonic() - sent))
            self.answers.append((response.status_code, response.text))
            if self.interval:
                due = max(due + self.interval, time.monotonic())
                self._stop.wait(max(0.0, due - time.monotonic()))

    def __enter__(self) -> SteadyCalls:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_timeout)
