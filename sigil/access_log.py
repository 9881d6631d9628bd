"""The access log: one line per call (logger `sigil.access`), its fields as the log's own
(sigil/logs.py: JSON or text, with the time, process and request id). The engine writes one
for each call it answers (capabilities/engine/access_log.py), the origin one for each call its
edge answered and reported (capabilities/services/edge_reports.py)."""

from __future__ import annotations

import logging

access_logger = logging.getLogger("sigil.access")


def access_logged() -> bool:
    """Whether access lines are written (the logger is on at INFO): nothing to build otherwise."""
    return access_logger.isEnabledFor(logging.INFO)


def access_line(
    *,
    method: str,
    path: str,
    status: int,
    capability: str | None,
    code: str | None,
    page_in_ms: float | None,
    ms: float,
    edge: bool,
    at_edge: bool = False,
) -> None:
    """One call's line: for an answer Sigil wrote as an error its error code; whether Sigil's
    edge handed the call on (`edge`), or served it itself and reported it (`at_edge`, and then
    `edge` too: the call came in at the edge)."""
    access_logger.info(
        "%s %s %d",
        method,
        path,
        status,
        extra={
            "method": method,
            "path": path,
            "capability": capability,
            "status": status,
            "code": code,
            "cold": page_in_ms is not None,
            "page_in_ms": None if page_in_ms is None else round(page_in_ms, 3),
            "ms": round(ms, 3),
            "edge": edge or at_edge,
            "at_edge": at_edge,
        },
    )
