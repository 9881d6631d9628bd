"""Calls made over and over in a thread while a test does something else beside them."""

from __future__ import annotations

import threading

import requests


class SteadyCalls:
    """GETs `url` with `headers` over and over in a thread while its `with` block lasts,
    keeping every (status, body) in `answers`."""

    def __init__(self, url: str, *, headers: dict[str, str], join_timeout: float = 60) -> None:
        self.url, self.headers, self.join_timeout = url, headers, join_timeout
        self.answers: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        session = requests.Session()  # its own: the test thread's is not shared
        while not self._stop.is_set():
            response = session.get(self.url, headers=self.headers, timeout=30)
            self.answers.append((response.status_code, response.text))

    def __enter__(self) -> SteadyCalls:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_timeout)
