"""Collecting the call records the Cloudflare runtimes' tails leave for Sigil (the beat's
task): each batch taken once, kept by capabilities.call_logs.

The loader host's tail names each record's capability and masks its secrets itself, in the
Worker that holds them. Sigil's Tail Worker (worker-pool, platform) sees only TraceItems: a
record names the script that produced it (the runtime's slot) and holds what the code wrote,
secrets and all; its batch says so (`slots`). Such a record is named here for the capability
that holds the slot and masked with that capability's secret values, before it is kept: the
values never reach the store. A record of a slot no capability holds is counted as lost.
"""

from __future__ import annotations

from capabilities import call_logs
from capabilities.bindings import bindings_resolve
from capabilities.models import BindingKind, Capability, State

# The shortest end of a cut line that is taken for the start of a secret value (and masked).
_CUT_SECRET_PREFIX = 4
_EXCEPTION_FIELDS = ("name", "message", "stack")


def call_records_collect(*, runtime, limit: int = 100) -> int:
    """Keep the batches of call records `runtime` left to be collected (in Workers KV);
    returns how many records were kept. A batch that cannot be read is counted as
    undelivered. Each batch is taken once: running this twice keeps nothing twice. Raises
    RuntimeUnavailable."""
    kept = 0
    for batch in runtime.call_records_take(limit=limit):
        records = batch.get("records")
        if not isinstance(records, list):
            call_logs.call_records_undelivered()
            continue
        if batch.get("slots") is True:
            records = _claimed(records, backend=runtime.name)
        kept += call_logs.call_records_keep(records=records)
        dropped = batch.get("dropped")
        if isinstance(dropped, int) and not isinstance(dropped, bool) and dropped > 0:
            call_logs.call_records_undelivered(count=dropped)  # the tail's queue was full
    return kept


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
