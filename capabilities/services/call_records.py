"""Keeping the batches of call records the runtimes' tails send Sigil, whichever way they
come: the local runtime's log sink (capabilities/log_sink.py) hands over what its workerd
processes post, and the origin's endpoint what Sigil's Workers on Cloudflare push
(`call_records_push`, whose batches carry the edge's reports too: edge_reports.py). Both keep
a batch with `call_records_batch_keep`, kept by capabilities.books.call_logs.

The loader host's tail names each record's capability and masks its secrets itself, in the
Worker that holds them. Sigil's Tail Worker (worker-pool, platform) sees only TraceItems: a
record names the script that produced it (the runtime's slot) and holds what the code wrote,
secrets and all; its batch says so (`slots`). Such a record is named here for the capability
that holds the slot and masked with that capability's secret values, before it is kept: the
values never reach the store. A record of a slot no capability holds is counted as lost.
"""

from __future__ import annotations

import json
import re
import time

from django.db import DatabaseError
from redis import RedisError

from capabilities import names
from capabilities.bindings import bindings_resolve
from capabilities.books import call_logs
from capabilities.log_limits import LogLimits
from capabilities.models import BindingKind, Capability, State
from capabilities.record_pushes import push_key, push_verify
from capabilities.services.edge_reports import edge_reports_apply, edge_reports_read
from sigil.errors import InvalidRequest

# The shortest end of a cut line that is taken for the start of a secret value (and masked).
_CUT_SECRET_PREFIX = 4
_EXCEPTION_FIELDS = ("name", "message", "stack")
# A pushed batch's id (host.js gives each a random UUID).
_BATCH_ID = re.compile(r"^[0-9A-Za-z-]{8,64}$")


def call_records_push(
    *, body: bytes, signed_at: str, signature: str, secret: str, backend: str, limits: LogLimits | None = None
) -> int:
    """Take a batch one of Sigil's Workers on Cloudflare pushed: check that it was signed with
    the key derived from `secret` within the allowed time (record_pushes), read it, apply the
    edge's reports it carries (`edge_reports_apply`) and keep its call records
    (`call_records_batch_keep`), each unless a batch of the same id was taken before. Returns
    how many records were kept (0 for a batch taken before).

    Raises Forbidden for a bad or stale signature, InvalidRequest for a body that is no batch:
    either way nothing is kept or counted (the Worker counts what it could not deliver).
    Idempotent: a batch pushed again is kept once, its reports applied once.
    """
    push_verify(key=push_key(secret), signed_at=signed_at, signature=signature, body=body, now=time.time())
    try:
        batch = json.loads(body)
    except ValueError as exc:
        raise InvalidRequest(f"a push's body is a JSON batch of call records ({exc})") from None
    if not isinstance(batch, dict) or not isinstance(batch.get("records"), list):
        raise InvalidRequest('a push\'s body is a batch: {"id": ..., "records": [...], "dropped": n}')
    batch_id = batch.get("id")
    if not isinstance(batch_id, str) or not _BATCH_ID.match(batch_id):
        raise InvalidRequest("a pushed batch carries its id (8 to 64 letters, digits and dashes)")
    limits = limits or LogLimits.from_settings()
    reports, reports_dropped = edge_reports_read(batch)
    if reports or reports_dropped:
        # Applied first, and once (their own note of the batch): should keeping the records
        # fail, the Worker pushes the batch again and only the records are kept then.
        edge_reports_apply(
            batch_id=batch_id, reports=reports, dropped=reports_dropped, kept_seconds=limits.retention_seconds
        )
    return call_records_batch_keep(batch=batch, backend=backend, limits=limits)


def call_records_batch_keep(*, batch: dict, backend: str, limits: LogLimits) -> int:
    """Keep one batch of call records a tail sent (`{"records": [...], "dropped": n}`, with
    `"slots": true` from Sigil's Tail Worker on `backend`, and an `"id"` when pushed): a
    Tail Worker's records named for their capabilities and masked, each record kept within
    `limits`, and `dropped` (records the tail could not deliver) counted as undelivered.
    Returns how many records were kept.

    A batch with an id is taken once: one already taken is ignored (0). Raises RedisError or
    DatabaseError, and then forgets that the batch was taken, so that a push again keeps it
    (with whatever records of it were kept before the failure a second time).
    """
    records = batch.get("records")
    if not isinstance(records, list):
        call_logs.call_records_undelivered()
        return 0
    batch_id = batch.get("id")
    claimed = isinstance(batch_id, str)
    retention = limits.retention_seconds
    if claimed and not call_logs.call_records_batch_claim(batch_id=batch_id, retention_seconds=retention):
        return 0  # pushed again: kept the first time
    try:
        slots = batch.get("slots") is True
        if slots:
            records = _claimed(records, backend=backend)
        kept = call_logs.call_records_keep(records=records, limits=limits)
        dropped = batch.get("dropped")
        if isinstance(dropped, int) and not isinstance(dropped, bool) and dropped > 0:
            # The tail's queue was full, or a batch refused or neither pushed nor spooled.
            by = _dropped_by(batch.get("dropped_by"), total=dropped, slots=slots, backend=backend)
            call_logs.call_records_undelivered(count=dropped, by=by)
    except (RedisError, DatabaseError):
        if claimed:
            call_logs.call_records_batch_unclaim(batch_id=batch_id)
        raise
    return kept


def _dropped_by(raw, *, total: int, slots: bool, backend: str) -> dict[str, int]:
    """A batch's `dropped_by` (slot → records its tail lost) as full name → records, for the
    capabilities that exist (a Tail Worker's slots named for their holders); what names none,
    or goes past `total`, stays in the undelivered count alone."""
    if not isinstance(raw, dict):
        return {}
    counts = {
        slot: count
        for slot, count in raw.items()
        if isinstance(slot, str) and isinstance(count, int) and not isinstance(count, bool) and count > 0
    }
    if slots:
        holders = Capability.objects.filter(slot__in=list(counts), backend=backend).exclude(state=State.REMOVED)
        named = {c.slot: c.full_name for c in holders}
        counts = {named[slot]: count for slot, count in counts.items() if slot in named}
    else:
        # A staged version in traffic runs as `{full}--v{n}`: its losses are its capability's.
        folded: dict[str, int] = {}
        for slot, count in counts.items():
            full = slot.rpartition(names.SEPARATOR)[0] if call_logs.VARIANT.search(slot) else slot
            folded[full] = folded.get(full, 0) + count
        counts = folded
    current = Capability.objects.filter(full_name__in=list(counts)).exclude(state=State.REMOVED)
    known = set(current.values_list("full_name", flat=True))
    by: dict[str, int] = {}
    left = total
    for full in sorted(known):
        count = min(counts[full], left)
        if count > 0:
            by[full] = count
            left -= count
    return by


def _claimed(records: list, *, backend: str) -> list:
    """`records` named for the capabilities holding their slots, their secrets masked."""
    slots = {r.get("capability") for r in records if isinstance(r, dict) and isinstance(r.get("capability"), str)}
    holders = {
        c.slot: c for c in Capability.objects.filter(slot__in=slots, backend=backend).exclude(state=State.REMOVED)
    }
    secrets: dict[str, list[tuple[str, str]]] = {}
    claimed = []
    for record in records:
        capability = holders.get(record.get("capability")) if isinstance(record, dict) else None
        if capability is None:
            claimed.append(record)  # refused, and counted, as it names no capability
            continue
        if capability.slot not in secrets:
            resolved = bindings_resolve(
                capability.bindings, agent_id=capability.agent_id, supported_kinds=None, strict=False
            )
            values = [(b.name, b.value) for b in resolved if b.kind == BindingKind.SECRET and b.value]
            secrets[capability.slot] = sorted(values, key=lambda pair: -len(pair[1]))
        claimed.append(_masked({**record, "capability": capability.full_name}, secrets[capability.slot]))
    return claimed


def _masked(record: dict, secrets: list[tuple[str, str]]) -> dict:
    if not secrets:
        return record
    logs = [
        {**line, "text": _mask(str(line.get("text", "")), secrets, cut=bool(line.get("cut")))}
        for line in record.get("logs") or []
        if isinstance(line, dict)
    ]
    exception = record.get("exception")
    if isinstance(exception, dict):
        exception = {key: _mask(str(exception.get(key) or ""), secrets, cut=True) for key in _EXCEPTION_FIELDS}
    return {**record, "logs": logs, "exception": exception}


def _mask(text: str, secrets: list[tuple[str, str]], *, cut: bool) -> str:
    """`text` with each secret value replaced by its binding's name; a text that was cut may
    end in the start of a value, which is masked too."""
    for name, value in secrets:
        text = text.replace(value, f"[secret {name}]")
    if cut:
        for name, value in secrets:
            for size in range(min(len(value) - 1, len(text)), _CUT_SECRET_PREFIX - 1, -1):
                if text.endswith(value[:size]):
                    return text[:-size] + f"[secret {name}]"
    return text
