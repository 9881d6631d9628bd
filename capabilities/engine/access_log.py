"""The access log: one line per call the engine answers (sigil/access_log.py)."""

from __future__ import annotations

import time

from capabilities.engine.values import CallRequest
from sigil.access_log import access_line, access_logged


def log_access(
    request: CallRequest,
    status: int,
    started: float,
    *,
    capability: str | None,
    page_in_ms: float | None,
    code: str | None = None,
) -> None:
    """One line per call (logger `sigil.access`), its fields as the log's own (sigil/logs.py:
    JSON or text, with the time, process and request id), for an answer Sigil wrote as an
    error its error code, and whether Sigil's edge handed the call on (`edge`)."""
    if not access_logged():
        return
    path = f"/{request.agent}/{request.name}{request.rest if request.rest != '/' else ''}"
    access_line(
        method=request.method,
        path=path,
        status=status,
        capability=capability,
        code=code,
        page_in_ms=page_in_ms,
        ms=(time.perf_counter() - started) * 1000,
        edge=request.via_edge,
    )
