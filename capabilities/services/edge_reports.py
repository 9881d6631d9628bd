"""What Sigil's edge reports of the calls it answered itself (capabilities/runtimes/edge/edge.js:
report), applied at the origin as the engine records a call of its own
(capabilities/engine/recording.py), so that the counters, breakers, failure records, tokens'
last use, the pager's access times and the access log are the same whichever plane served a
call (docs/architecture.md, "The two planes").

A report of a call that reached the capability's code is a stats.CallRecord, applied by
stats.RECORD_CALLS as the engine applies its own; one of an answer the edge gave for Sigil (a
`401`, `404`, `413`, `503 degraded`, a runtime's failure) is counted as the engine counts its
own (stats.answer_count_queue). A half-open breaker's trial never happens at the edge (the
origin runs it), nor a page-in, nor a call counted in flight for the pager.

The reports travel by the report channel, in the call records' signed pushes
(`call_records_push`). A batch's reports are applied in one Redis transaction with the note that
the batch was taken: a batch pushed twice counts once, and one that fails to apply leaves
nothing applied (the Worker pushes it again). Then, as the engine does after its script call,
each breaker transition is acted on (observability.breaker_changed: persisted, and the route
marked to be published to the edge again), a staged version's refusals count toward its split's
guard, and the access log has its lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from django.conf import settings
from redis.exceptions import WatchError

from capabilities import names
from capabilities.books import breaker, failures, stats
from capabilities.models import CapabilityType
from capabilities.services.observability import breaker_changed, breaker_refused
from sigil import redis_keys
from sigil.access_log import access_line, access_logged
from sigil.errors import Degraded, InvalidRequest
from sigil.redis_client import get_redis
from sigil.request_id import request_id_as

# Reports one batch holds at most (channel.js BATCH_REPORTS): one Redis transaction applies them.
REPORTS_PER_BATCH = 512
_TOKEN_HASH_CHARS = 64
_PATH_CHARS = 2048


@dataclass(frozen=True, slots=True)
class EdgeCall:
    """A call the edge served, as a stats.CallRecord reads it (stats.RecordedCall)."""

    full: str
    capability_type: str
    token_hash: str
    is_trial: bool = False  # the origin runs a half-open breaker's trial, never the edge
    inflight_process: str | None = None  # the edge's calls are not counted in flight
    page_in_ms: float | None = None  # nor paged in: a capability not live is the origin's


@dataclass(frozen=True, slots=True)
class EdgeReport:
    """One call the edge answered itself. `reached`: the capability's code answered it (a
    call, `ok` unless it failed, with the failure's `message`); otherwise the edge answered for
    Sigil (`code`), counted on `capability` when the call named one."""

    request_id: str
    at_epoch: float  # when the edge had the answer
    method: str
    path: str
    capability: str | None  # what is placed and counted: a staged version's own name in a split
    capability_type: str | None
    token_hash: str | None
    version: int | None
    status: int
    code: str | None
    duration_ms: float
    reached: bool
    ok: bool
    message: str

    @classmethod
    def read(cls, raw: object) -> EdgeReport:
        """A report as edge.js:callReport writes it. Raises InvalidRequest for anything else."""
        if not isinstance(raw, dict):
            raise InvalidRequest("an edge report is a JSON object")
        reached = _typed(raw, "call", bool)
        capability = _typed(raw, "capability", str, optional=True)
        if capability is not None:
            _placement_name(capability)
        report = cls(
            request_id=_typed(raw, "rid", str)[:64],
            at_epoch=float(_typed(raw, "at", (int, float))),
            method=_typed(raw, "method", str)[:16],
            path=_typed(raw, "path", str)[:_PATH_CHARS],
            capability=capability,
            capability_type=_typed(raw, "type", str, optional=True),
            token_hash=_typed(raw, "token", str, optional=True),
            version=_typed(raw, "version", int, optional=True),
            status=_typed(raw, "status", int),
            code=_typed(raw, "code", str, optional=True),
            duration_ms=max(0.0, float(_typed(raw, "ms", (int, float)))),
            reached=reached,
            ok=_typed(raw, "ok", bool),
            message=_typed(raw, "message", str)[: failures.MESSAGE_MAX_CHARS],
        )
        if not 100 <= report.status <= 599:
            raise InvalidRequest(f"an edge report's status {report.status} is no HTTP status")
        if reached and (
            capability is None
            or report.capability_type not in CapabilityType.values
            or report.token_hash is None
            or len(report.token_hash) != _TOKEN_HASH_CHARS
        ):
            raise InvalidRequest("an edge report of a call names its capability, its type and its token's hash")
        return report

    def call_record(self, *, now_epoch: float) -> stats.CallRecord:
        """The record the engine would have made of this call, as of when the edge answered it
        (never later than `now_epoch`, this server's clock)."""
        at = min(self.at_epoch, now_epoch)
        failure = ""
        if not self.ok:
            failure = failures.failure_encode(
                status=self.status,
                code=self.code,
                message=self.message,
                duration_ms=self.duration_ms,
                request_id=self.request_id,
                version=self.version,
                at_epoch=at,
            )
        call = EdgeCall(full=self.capability, capability_type=self.capability_type, token_hash=self.token_hash)
        return stats.CallRecord(
            call,
            at_epoch=at,
            latency_ms=self.duration_ms,
            status=self.status,
            ok=self.ok,
            code=self.code,
            failure=failure,
        )


def edge_reports_read(batch: dict) -> tuple[list[EdgeReport], int]:
    """The reports a pushed batch carries (`reports`), and how many its Worker could not
    deliver (`reports_dropped`). Raises InvalidRequest for a batch whose reports are malformed
    or too many: nothing of it is applied."""
    raw = batch.get("reports", [])
    if not isinstance(raw, list):
        raise InvalidRequest("a batch's reports are a list")
    if len(raw) > REPORTS_PER_BATCH:
        raise InvalidRequest(f"a batch holds at most {REPORTS_PER_BATCH} reports; this one holds {len(raw)}")
    dropped = batch.get("reports_dropped", 0)
    if not isinstance(dropped, int) or isinstance(dropped, bool) or dropped < 0:
        raise InvalidRequest("a batch's reports_dropped is a count")
    return [EdgeReport.read(report) for report in raw], dropped


def edge_reports_apply(
    *, batch_id: str, reports: list[EdgeReport], dropped: int, kept_seconds: int, now_epoch: float | None = None
) -> int:
    """Apply a pushed batch's reports: each call's record (stats.RECORD_CALLS), each answer's
    count (stats.answer_count_queue), the reports counted and `dropped` counted as lost, all in
    one Redis transaction with the note that batch `batch_id` was taken (kept `kept_seconds`);
    then the breaker transitions they made, a staged version's refusals and the access lines.
    Returns how many reports were applied: 0 for a batch taken before.

    Idempotent: a batch applied before is not applied again. Raises what an unreachable Redis
    raises, with nothing applied."""
    now_epoch = time.time() if now_epoch is None else now_epoch
    rules = breaker.Breaker.from_settings()
    calls = [(report, report.call_record(now_epoch=now_epoch)) for report in reports if report.reached]
    keys, args = [], []
    for _, record in calls:
        keys += record.keys()
        args += record.args(
            rules=rules,
            failures_kept=settings.SIGIL_FAILURES_KEPT,
            access_log_length=settings.SIGIL_ACCESS_PATTERN_MAX_CALLS,
        )
    redis = get_redis()
    record_calls = redis.register_script(stats.RECORD_CALLS)
    taken = redis_keys.edge_reports_taken(batch_id)
    with redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(taken)  # two pushes of one batch at once: one applies it
                if pipe.exists(taken):
                    return 0
                pipe.multi()
                pipe.set(taken, 1, ex=max(1, kept_seconds))
                if calls:
                    record_calls(keys=keys, args=args, client=pipe)
                for report in reports:
                    if not report.reached:
                        stats.answer_count_queue(pipe, full=report.capability, status=report.status, code=report.code)
                stats.edge_reports_count_queue(pipe, applied=len(reports), lost=dropped)
                applied = pipe.execute()
                break
            except WatchError:
                continue
    changes = applied[1] if calls else []
    for (_, record), change in zip(calls, changes, strict=True):
        if change:
            breaker_changed(full=record.call.full, change=change, at_epoch=record.at_epoch)
    for report in reports:
        if report.code == Degraded.code and report.capability is not None:
            breaker_refused(redis, full=report.capability)
    if access_logged():
        for report in reports:
            with request_id_as(report.request_id):
                access_line(
                    method=report.method,
                    path=report.path,
                    status=report.status,
                    capability=report.capability,
                    code=report.code,
                    page_in_ms=None,
                    ms=report.duration_ms,
                    edge=True,
                    at_edge=True,
                )
    return len(reports)


def _typed(raw: dict, field: str, kind, *, optional: bool = False):
    value = raw.get(field)
    if value is None and optional:
        return None
    # JSON's true is no number here, nor a number a boolean.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InvalidRequest(f"an edge report's {field!r} is {'missing or ' if value is None else ''}of the wrong type")
    return value


def _placement_name(full: str) -> None:
    """Raises InvalidRequest unless `full` names a capability, or a staged version's placement."""
    if names.is_variant(full):
        full = full.rpartition(names.SEPARATOR)[0]
    names.split_full_name(full)
