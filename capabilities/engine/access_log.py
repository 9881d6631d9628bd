"""The access log: one line per call, logger `sigil.access`."""

from __future__ import annotations

import logging
import time

from capabilities.engine.values import CallRequest

access_logger = logging.getLogger("sigil.access")


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
    if not access_logger.isEnabledFor(logging.INFO):
        return
    ms = round((time.perf_counter() - started) * 1000, 3)
    path = f"/{request.agent}/{request.name}{request.rest if request.rest != '/' else ''}"
    access_logger.info(
        "%s %s %d",
        request.method,
        path,
        status,
        extra={
            "method": request.method,
            "path": path,
            "capability": capability,
            "status": status,
            "code": code,
            "cold": page_in_ms is not None,
            "page_in_ms": None if page_in_ms is None else round(page_in_ms, 3),
            "ms": ms,
            "edge": request.via_edge,
        },
    )
