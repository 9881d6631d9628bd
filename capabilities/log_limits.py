"""The bounds on what a call's record keeps (lines per call, bytes per line, records per
capability, how long, bytes per agent), and on what travels at once (a batch): applied by the
runtime's tail as it shapes them and again by the store (capabilities/books/call_logs.py)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

# Records one batch holds at most (host.js BATCH_RECORDS).
BATCH_RECORDS = 64


@dataclass(frozen=True)
class LogLimits:
    """The bounds on what is kept, from settings."""

    lines_per_call: int
    line_bytes: int
    records_per_capability: int
    retention_seconds: int
    agent_bytes: int
    #: batches one Worker isolate on Cloudflare spools while the origin cannot be reached
    spool_batches: int = 100

    @classmethod
    def from_settings(cls) -> LogLimits:
        return cls(
            lines_per_call=settings.SIGIL_LOGS_LINES_PER_CALL,
            line_bytes=settings.SIGIL_LOGS_LINE_BYTES,
            records_per_capability=settings.SIGIL_LOGS_RECORDS_PER_CAPABILITY,
            retention_seconds=settings.SIGIL_LOGS_RETENTION_SECONDS,
            agent_bytes=settings.SIGIL_LOGS_AGENT_BYTES,
            spool_batches=settings.SIGIL_LOGS_SPOOL_BATCHES,
        )

    @property
    def batch_bytes(self) -> int:
        """The largest batch body the log sink and the origin take: BATCH_RECORDS records, each
        within the per-call bounds (a line's JSON escaping and fields, a record's other fields)."""
        return BATCH_RECORDS * (self.lines_per_call * (self.line_bytes + 64) + 8192)

    def for_host(self) -> dict:
        """What a runtime's tail reads of them (LOG_LIMITS): the per-call bounds, the largest
        batch it sends, and, on Cloudflare, how long a batch it spools waits (the records'
        retention) and how many one isolate spools."""
        return {
            "lines": self.lines_per_call,
            "lineBytes": self.line_bytes,
            "batchBytes": self.batch_bytes,
            "retentionSeconds": self.retention_seconds,
            "spoolBatches": self.spool_batches,
        }


def host_log_limits() -> dict | None:
    """The per-call bounds a runtime's tail applies (LogLimits.for_host), from settings; None
    while call records are off (SIGIL_LOGS_ENABLED)."""
    return LogLimits.from_settings().for_host() if settings.SIGIL_LOGS_ENABLED else None
