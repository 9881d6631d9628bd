"""Cloudflare's API rate limit: a number of calls per window, and the lock-out past it."""

from __future__ import annotations

import math
from collections import deque


def parse_rate_limit(text: str) -> tuple[int, float]:
    """`"1200/300"` -> (1200, 300.0): requests per window of seconds. Raises ValueError."""
    count, _, window = text.partition("/")
    try:
        limit, seconds = int(count), float(window)
    except ValueError:
        raise ValueError(f"a rate limit is REQUESTS/SECONDS, like 1200/300, not {text!r}") from None
    if limit < 1 or seconds <= 0:
        raise ValueError(f"a rate limit needs at least 1 request in a positive window, not {text!r}")
    return limit, seconds


class LockoutWindow:
    """Cloudflare's API rate limit: over `limit` calls in `window` s blocks every call for `window` s."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit
        self.window = window
        self._calls: deque[float] = deque()
        self._blocked_until = 0.0

    def admit(self, now: float) -> float | None:
        """Count one call; None when it may proceed, else the seconds until the lockout ends."""
        if now < self._blocked_until:
            return self._blocked_until - now
        while self._calls and self._calls[0] <= now - self.window:
            self._calls.popleft()
        if len(self._calls) >= self.limit:
            self._blocked_until = now + self.window
            return self.window
        self._calls.append(now)
        return None

    def headers(self, now: float) -> list[tuple[str, str]]:
        """The `Ratelimit` headers Cloudflare sends on every response (reference §7.2)."""
        remaining = max(0, self.limit - len(self._calls))
        reset = self._calls[0] + self.window - now if self._calls else self.window
        return [
            ("Ratelimit", f'"default";r={remaining};t={max(0, math.ceil(reset))}'),
            ("Ratelimit-Policy", f'"default";q={self.limit};w={self.window:g}'),
        ]
