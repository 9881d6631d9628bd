"""Calls made over and over in a thread while a test does something else beside them."""

from __future__ import annotations

import threading
import time

import requests


class SteadyCalls:
    """GETs `url` with `headers` (or POSTs `body`, when given) over and over in a thread while
    its `with` block lasts, keeping every (status, body) in `answers` and, in `timings`, when
    each was sent (`time.monotonic()`) and how many seconds it took to be answered."""

    def __init__(
        self, url: str, *, headers: dict[str, str], body: bytes | None = None, join_timeout: float = 60
    ) -> None:
        self.url, self.headers, self.body, self.join_timeout = url, headers, body, join_timeout
        self.answers: list[tuple[int, str]] = []
        self.timings: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        session = requests.Session()  # its own: the test thread's is not shared
        method = "GET" if self.body is None else "POST"
        while not self._stop.is_set():
            sent = time.monotonic()
            response = session.request(method, self.url, headers=self.headers, data=self.body, timeout=30)
            self.timings.append((sent, time.monotonic() - sent))
            self.answers.append((response.status_code, response.text))

    def __enter__(self) -> SteadyCalls:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_timeout)
