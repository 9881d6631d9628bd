"""The bounds on what a call's record keeps (lines per call, bytes per line, records per
capability, how long, bytes per agent): applied by the runtime's tail as it collects and again
by the store (capabilities/call_logs.py)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings


@dataclass(frozen=True)
class LogLimits:
    """The bounds on what is kept, from settings."""

    lines_per_call: int
    line_bytes: int
    records_per_capability: int
    retention_seconds: int
    agent_bytes: int

    @classmethod
    def from_settings(cls) -> LogLimits:
        return cls(
            lines_per_call=settings.SIGIL_LOGS_LINES_PER_CALL,
            line_bytes=settings.SIGIL_LOGS_LINE_BYTES,
            records_per_capability=settings.SIGIL_LOGS_RECORDS_PER_CAPABILITY,
            retention_seconds=settings.SIGIL_LOGS_RETENTION_SECONDS,
            agent_bytes=settings.SIGIL_LOGS_AGENT_BYTES,
        )

    def for_host(self) -> dict:
        """The per-call bounds as the loader host's tail reads them (LOG_LIMITS), and how long
        a batch left in Workers KV for Sigil waits to be collected (the records' retention)."""
        return {"lines": self.lines_per_call, "lineBytes": self.line_bytes, "retentionSeconds": self.retention_seconds}


def host_log_limits() -> dict | None:
    """The per-call bounds a runtime's tail applies (LogLimits.for_host), from settings; None
    while call records are off (SIGIL_LOGS_ENABLED)."""
    return LogLimits.from_settings().for_host() if settings.SIGIL_LOGS_ENABLED else None
