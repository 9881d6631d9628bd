"""The answers the engine writes itself: its errors in the contract's envelope, a degraded
capability's cached answer, and the headers it adds to a capability's own answer."""

from __future__ import annotations

import time

from capabilities.books import degraded_cache
from capabilities.engine.calls import Call
from capabilities.engine.values import CallAnswer
from sigil.errors import SigilError, error_body, error_headers

# On every answer the engine writes itself (never on a capability's own responses, which
# pass through unchanged): a browser must not guess a type other than the one sent.
NOSNIFF = ("X-Content-Type-Options", "nosniff")

STATUS_TEXT = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    409: "Conflict",
    413: "Content Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def error_answer(error: SigilError) -> CallAnswer:
    body = error_body(error)
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))), NOSNIFF]
    headers.extend(error_headers(error).items())
    return CallAnswer(error.status, STATUS_TEXT.get(error.status, ""), headers, body, code=error.code)


def cached_reply(cached: degraded_cache.CachedAnswer, now: float) -> CallAnswer:
    headers = [*cached.headers, ("Content-Length", str(len(cached.body)))]
    headers += [degraded_cache.CACHE_HEADER, ("Age", str(int(max(0.0, now - cached.stored_epoch))))]
    return CallAnswer(cached.status, cached.reason, headers, cached.body)


def call_headers(call: Call, *, upstream_ms: float | None = None) -> list[tuple[str, str]]:
    """What Sigil adds to an answer of the capability's: the capability called, the version
    that answered, whether the call placed it and, given the capability's own time, Server-Timing
    (Sigil's own time, the capability's, the page-in's)."""
    page_in_ms = call.page_in_ms
    headers = [("X-Sigil-Capability", call.shown)]
    if call.version is not None:
        headers.append(("X-Sigil-Version", str(call.version)))
    if page_in_ms is not None:
        headers.append(("X-Sigil-Cold-Start", "1"))
    if upstream_ms is not None:
        sigil_ms = (time.perf_counter() - call.started) * 1000 - upstream_ms - (page_in_ms or 0)
        timing = f"sigil;dur={sigil_ms:.2f}, capability;dur={upstream_ms:.2f}"
        if page_in_ms is not None:
            timing += f", page-in;dur={page_in_ms:.2f}"
        headers.append(("Server-Timing", timing))
    return headers


def cache_target(rest: str, query: str | None) -> str:
    """What a degraded capability's cached answers are kept under: the path and query."""
    return rest + ("?" + query if query else "")
