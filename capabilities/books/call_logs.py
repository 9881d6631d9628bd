"""Each call's record (its console lines, uncaught exception and outcome), kept in Redis for
the capability's owner, and the bounds and loss counts around it.

The records come from the runtime's own tail events, after the call is over: the loader
host's SigilTail entrypoint (capabilities/runtimes/host/host.js) is each capability's tail,
shapes the events into records (lines per call and bytes per line cut there, secret values
replaced by their binding's name there, so they never leave workerd), and posts them to the
log sink (capabilities/log_sink.py); on Cloudflare the tails push them to the origin. Either
way capabilities.services.call_records keeps each batch, with call_records_keep(). Nothing on
the call's path waits for them or touches these keys.

Keys (named in sigil/redis_keys.py):

- `logs(full)`: the capability's records, a list of JSON documents, newest first, at
  most SIGIL_LOGS_RECORDS_PER_CAPABILITY, none older than SIGIL_LOGS_RETENTION_SECONDS (pruned
  when a record is kept and when they are read).
- `logs_bytes(agent)`: a hash, full name → bytes its records hold; their sum is held
  under SIGIL_LOGS_AGENT_BYTES. A capability makes room by dropping its own oldest records,
  never another's, so one capability's burst cannot crowd out its siblings' records.
- `LOGS_LOST`: a hash, full name → records that could not be kept (over the agent's
  bytes, or refused by the sink); `LOGS_UNDELIVERED` counts records the runtime
  lost before they reached Sigil (a tail's queue full, a batch refused or neither pushed nor
  spooled) and batches the sink could not read at all; `LOGS_UNDELIVERED_BY` is
  the part of those counted for a capability (full name → records), which its owner sees.
  A capability's `lost` is the sum of its two; /metrics shows both totals.
- `LOGS_SEQ`: the sequence number every kept record takes (the tail's and the pages'
  cursor).
- `logs_taken(batch id)`: a batch pushed from Cloudflare that was taken, kept for the
  records' retention, so that the same batch pushed again is kept once;
  `LOGS_PUSHES` counts the pushed batches taken and `LOGS_PUSHES_AGAIN` those
  pushed again, and ignored (on /metrics).
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from django.conf import settings

from capabilities import names
from capabilities.books import routes
from capabilities.log_limits import LogLimits
from sigil import redis_keys
from sigil.errors import InvalidRequest
from sigil.redis_client import get_redis

LEVELS = ("debug", "info", "log", "warn", "error")
OUTCOMES_FAILED = frozenset({"exception", "exceededCpu", "exceededMemory", "canceled", "scriptNotFound", "unknown"})
VARIANT = re.compile(r"--v[0-9]+$")


# Keeps the records of one batch, in order, each within the bounds. KEYS[1] and KEYS[2] are
# the lost counts and the sequence; then, for each capability of the batch, its records'
# list and its agent's bytes. ARGV: the bounds and the time (ARGV[1] to ARGV[4]), then three
# per record: its capability's place among the KEYS pairs (1, 2, ...), its full name, and the
# record (a JSON object without its sequence number). Returns each record's sequence number,
# or 0 for one that could not be kept (counted as lost). One script call per batch: a record
# costs Redis a few list and hash commands, not a script call of its own.
KEEP_RECORDS = """
local lost, seqkey = KEYS[1], KEYS[2]
local max_records, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local oldest_kept = now - tonumber(ARGV[4])
local seqs = {}
for i = 5, #ARGV, 3 do
  local place = tonumber(ARGV[i])
  local list, bytes = KEYS[1 + 2 * place], KEYS[2 + 2 * place]
  local full, rec = ARGV[i + 1], ARGV[i + 2]
  if redis.call('EXISTS', list) == 0 then redis.call('HDEL', bytes, full) end
  local function drop_oldest()
    local old = redis.call('RPOP', list)
    if old then redis.call('HINCRBY', bytes, full, -#old) end
    return old
  end
  while true do
    local old = redis.call('LINDEX', list, -1)
    if not old or (tonumber(cjson.decode(old)['at']) or 0) >= oldest_kept then break end
    drop_oldest()
  end
  local seq = redis.call('INCR', seqkey)
  local item = '{"seq":' .. seq .. ',' .. string.sub(rec, 2)
  local size = #item
  local total = 0
  for _, v in ipairs(redis.call('HVALS', bytes)) do total = total + tonumber(v) end
  while total + size > max_bytes do
    local old = drop_oldest()
    if not old then break end
    total = total - #old
  end
  if total + size > max_bytes then
    redis.call('HINCRBY', lost, full, 1)
    seqs[#seqs + 1] = 0
  else
    redis.call('LPUSH', list, item)
    redis.call('HINCRBY', bytes, full, size)
    while redis.call('LLEN', list) > max_records do drop_oldest() end
    seqs[#seqs + 1] = seq
  end
end
return seqs
"""


class RecordRefused(ValueError):
    """A record that is not one the host writes (malformed, or of no capability name)."""


def call_record_clean(
    raw: dict, *, limits: LogLimits, version_of: Callable[[str, str], int | None] | None = None
) -> tuple[str, dict]:
    """The capability's full name and the record as kept, from one record the tail posted.

    The host already applied the per-call bounds; they are applied again here so that the
    store's bound holds whatever posts. `version_of(slot, sha)` gives the version (by default
    read from the slot's route). Raises RecordRefused for a malformed record.
    """
    if not isinstance(raw, dict):
        raise RecordRefused("a record is a JSON object")
    slot = raw.get("capability")
    if not isinstance(slot, str):
        raise RecordRefused("a record names its capability")
    # A staged version in traffic runs under `{full}--v{n}` (routes.variant_name): its calls
    # are its capability's, and its route says which version it is.
    full = slot.rpartition(names.SEPARATOR)[0] if VARIANT.search(slot) else slot
    try:
        names.split_full_name(full)
    except InvalidRequest as exc:
        raise RecordRefused(str(exc)) from exc
    request_id = raw.get("request_id")
    if not isinstance(request_id, str) or not request_id or len(request_id) > 64:
        raise RecordRefused("a record carries the call's request id")
    lines = raw.get("logs") if isinstance(raw.get("logs"), list) else []
    lines_cut = _int(raw.get("lines_cut")) + max(0, len(lines) - limits.lines_per_call)
    logs = []
    shortened = 0
    for line in lines[: limits.lines_per_call]:
        if not isinstance(line, dict):
            continue
        text, was_cut = _cut(str(line.get("text", "")), limits.line_bytes)
        was_cut = was_cut or bool(line.get("cut"))
        shortened += was_cut
        level = line.get("level") if line.get("level") in LEVELS else "log"
        logs.append({"level": level, "at": _float(line.get("at")), "text": text, "cut": was_cut})
    exception = None
    if isinstance(raw.get("exception"), dict):
        thrown = raw["exception"]
        exception = {
            "name": _cut(str(thrown.get("name") or ""), limits.line_bytes)[0],
            "message": _cut(str(thrown.get("message") or ""), limits.line_bytes)[0],
            "stack": _cut(str(thrown.get("stack") or ""), limits.line_bytes * 4)[0],
        }
    sha = raw.get("sha") if isinstance(raw.get("sha"), str) else ""
    record = {
        "at": _float(raw.get("at")) or time.time(),
        "request_id": request_id,
        "outcome": str(raw.get("outcome") or "unknown")[:32],
        "status": raw.get("status") if isinstance(raw.get("status"), int) else None,
        "wall_ms": _float(raw.get("wall_ms")),
        "cpu_ms": _float(raw.get("cpu_ms")),
        "cold": bool(raw.get("cold")),
        "sha": sha[:64],
        "version": (version_of or _version_of)(slot, sha),
        "logs": logs,
        "lines_cut": lines_cut,
        "lines_shortened": max(shortened, _int(raw.get("lines_shortened"))),
        "exception": exception,
        "runtime_truncated": bool(raw.get("runtime_truncated")),
    }
    return full, record


def call_records_keep(*, records: list, limits: LogLimits | None = None) -> int:
    """Keep the records one tail batch posted, each within the bounds; returns how many were
    kept. A record that is malformed or does not fit is counted as lost for its capability
    (or as undelivered, when it names none). Not idempotent: a batch posted twice is kept twice
    (a pushed batch is claimed first: call_records_batch_claim).

    The whole batch is kept in one round trip (one script call for all its records, kept in
    order), and each slot's route read once for it, not once a record: a batch holds the
    records of every call that ended within a moment, and the sink takes them beside the calls.
    """
    limits = limits or LogLimits.from_settings()
    client = get_redis()
    version_of = functools.cache(_version_of)
    keys = [redis_keys.LOGS_LOST, redis_keys.LOGS_SEQ]
    places: dict[str, int] = {}  # full name → its place among the KEYS pairs
    args: list = [limits.records_per_capability, limits.agent_bytes, time.time(), limits.retention_seconds]
    refused_by: dict[str, int] = {}
    refused_unnamed = 0
    for raw in records:
        try:
            full, record = call_record_clean(raw, limits=limits, version_of=version_of)
        except RecordRefused:
            full = raw.get("capability") if isinstance(raw, dict) else None
            if isinstance(full, str) and len(full) <= 200:
                refused_by[full] = refused_by.get(full, 0) + 1
            else:
                refused_unnamed += 1
            continue
        place = places.get(full)
        if place is None:
            place = places[full] = len(places) + 1
            keys += [redis_keys.logs(full), redis_keys.logs_bytes(full.partition(names.SEPARATOR)[0])]
        args += [place, full, json.dumps(record, separators=(",", ":"))]
    pipe = client.pipeline(transaction=False)
    for full, count in refused_by.items():
        pipe.hincrby(redis_keys.LOGS_LOST, full, count)
    if refused_unnamed:
        pipe.incr(redis_keys.LOGS_UNDELIVERED, refused_unnamed)
    if not places:
        if refused_by or refused_unnamed:
            pipe.execute()
        return 0
    keep = client.register_script(KEEP_RECORDS)
    if not len(pipe):  # nothing refused (as a rule): the script alone, no pipeline
        return sum(1 for seq in keep(keys=keys, args=args) if seq)
    keep(keys=keys, args=args, client=pipe)
    return sum(1 for seq in pipe.execute()[-1] if seq)


# Notes a pushed batch as taken (KEYS[1], for ARGV[1] seconds) unless it was, and counts it as
# taken first (KEYS[2]) or again (KEYS[3]); 1 when it was not taken before.
CLAIM_BATCH = """
if redis.call('SET', KEYS[1], 1, 'NX', 'EX', ARGV[1]) then
  redis.call('INCR', KEYS[2])
  return 1
end
redis.call('INCR', KEYS[3])
return 0
"""


def call_records_batch_claim(*, batch_id: str, retention_seconds: int) -> bool:
    """Note the pushed batch `batch_id` as taken, for `retention_seconds` (past it, its records
    would be dropped for their age anyway); False when it was taken before. One round trip."""
    client = get_redis()
    keys = [redis_keys.logs_taken(batch_id), redis_keys.LOGS_PUSHES, redis_keys.LOGS_PUSHES_AGAIN]
    return bool(client.register_script(CLAIM_BATCH)(keys=keys, args=[max(1, retention_seconds)]))


def call_records_batch_unclaim(*, batch_id: str) -> None:
    """Forget that `batch_id` was taken (it could not be kept after all: a push again keeps it)."""
    pipe = get_redis().pipeline(transaction=True)
    pipe.delete(redis_keys.logs_taken(batch_id))
    pipe.decr(redis_keys.LOGS_PUSHES)
    pipe.execute()


def call_records_pushes() -> tuple[int, int]:
    """Pushed batches taken the first time, and those pushed again (ignored)."""
    first, again = get_redis().mget(redis_keys.LOGS_PUSHES, redis_keys.LOGS_PUSHES_AGAIN)
    return int(first or 0), int(again or 0)


def call_records_undelivered(*, count: int = 1, by: dict[str, int] | None = None) -> None:
    """Count `count` records (or batches) that could not be kept at all: a batch the sink
    could not read, or records a tail could not deliver (a batch's `dropped`), of which `by`
    says how many were whose (full name → records), so that each capability's owner sees
    its own. One round trip."""
    pipe = get_redis().pipeline(transaction=False)
    pipe.incr(redis_keys.LOGS_UNDELIVERED, count)
    for full, lost in (by or {}).items():
        pipe.hincrby(redis_keys.LOGS_UNDELIVERED_BY, full, lost)
    pipe.execute()


@dataclass(frozen=True)
class RecordQuery:
    """Which records of a capability to read, newest first: those of the call with `request_id`,
    with a line at `level` or above (`error` also matches an uncaught exception or a failed
    outcome), made at or after `since` (epoch), older than the cursor `before` or newer than
    `after` (sequence numbers); at most `limit` of them."""

    request_id: str | None = None
    level: str | None = None
    since: float | None = None
    before: int | None = None
    after: int | None = None
    limit: int = 20


@dataclass(frozen=True)
class RecordPage:
    records: list[dict]
    next_before: int | None  # the cursor of the next (older) page; None on the last


def call_records_list(
    *, full: str, query: RecordQuery | None = None, retention_seconds: int | None = None
) -> RecordPage:
    """The records of `full`, newest first, that match every filter of `query` (without one: the
    latest 20). Records past the retention are never returned."""
    query = query or RecordQuery()
    request_id, before, after, limit = query.request_id, query.before, query.after, query.limit
    retention = settings.SIGIL_LOGS_RETENTION_SECONDS if retention_seconds is None else retention_seconds
    oldest = max(query.since or 0.0, time.time() - retention)
    floor = LEVELS.index(query.level) if query.level in LEVELS else None
    matched = []
    more = False
    for raw in get_redis().lrange(redis_keys.logs(full), 0, -1):
        record = json.loads(raw)
        if record["at"] < oldest:
            break  # newest first: every later one is older still
        if before is not None and record["seq"] >= before:
            continue
        if after is not None and record["seq"] <= after:
            break
        if request_id is not None and record["request_id"] != request_id:
            continue
        if floor is not None and not _reaches(record, floor):
            continue
        if len(matched) == limit:
            more = True
            break
        matched.append(record)
    return RecordPage(records=matched, next_before=matched[-1]["seq"] if more else None)


def call_records_newest_seq(*, full: str) -> int:
    """The sequence number of the newest record of `full`; 0 when it has none."""
    newest = get_redis().lindex(redis_keys.logs(full), 0)
    return json.loads(newest)["seq"] if newest else 0


def call_records_follow(
    *,
    full: str,
    after: int | None = None,
    seconds: float,
    poll_seconds: float = 0.2,
    heartbeat_seconds: float = 5.0,
) -> Iterator[dict | None]:
    """The records of `full` newer than the sequence number `after` (when None: than its
    newest now), oldest first, as they are kept, for `seconds`; None every `heartbeat_seconds`
    without one, so that a caller that went away is noticed. One LRANGE per poll."""
    if after is None:
        after = call_records_newest_seq(full=full)
    deadline = time.monotonic() + seconds
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        # The list holds at most SIGIL_LOGS_RECORDS_PER_CAPABILITY: all of it newer than
        # `after` fits in one page.
        page = call_records_list(
            full=full, query=RecordQuery(after=after, limit=settings.SIGIL_LOGS_RECORDS_PER_CAPABILITY)
        )
        for record in reversed(page.records):
            after = record["seq"]
            quiet_since = time.monotonic()
            yield record
        if time.monotonic() - quiet_since >= heartbeat_seconds:
            quiet_since = time.monotonic()
            yield None
        time.sleep(min(poll_seconds, max(0.0, deadline - time.monotonic())))


def call_records_alert_fields(*, full: str, failures: int = 5) -> dict:
    """What an alert about `full` carries to point at its calls: the request ids of its latest
    failures (newest first), and where the owning agent reads their records."""
    from capabilities.books.failures import failures_list

    base = settings.SIGIL_PUBLIC_URL.rstrip("/")
    return {
        "request_ids": [f.request_id for f in failures_list(full=full, limit=failures)],
        "logs": f"{base}/_api/capabilities/{full}/logs?level=error",
    }


def call_records_lost(*, full: str) -> int:
    """Records of `full` lost: that reached Sigil and could not be kept, or that the runtime
    lost on their way (counted by its tail)."""
    pipe = get_redis().pipeline(transaction=False)
    pipe.hget(redis_keys.LOGS_LOST, full)
    pipe.hget(redis_keys.LOGS_UNDELIVERED_BY, full)
    return sum(int(value or 0) for value in pipe.execute())


def call_records_lost_kept() -> int:
    """Records of every capability that reached Sigil and could not be kept."""
    return sum(int(v) for v in get_redis().hvals(redis_keys.LOGS_LOST))


def call_records_undelivered_count() -> int:
    """Batches (or records naming no capability) that reached the sink and could not be read."""
    return int(get_redis().get(redis_keys.LOGS_UNDELIVERED) or 0)


def call_records_forget(*, full: str) -> None:
    """Drop every record of `full` and its loss count (it was removed). Idempotent."""
    agent = full.partition(names.SEPARATOR)[0]
    client = get_redis()
    pipe = client.pipeline(transaction=True)
    pipe.delete(redis_keys.logs(full))
    pipe.hdel(redis_keys.logs_bytes(agent), full)
    pipe.hdel(redis_keys.LOGS_LOST, full)
    pipe.hdel(redis_keys.LOGS_UNDELIVERED_BY, full)
    pipe.execute()


def record_reaches(record: dict, level: str) -> bool:
    """Whether `record` has a line at `level` or above (for `error`: or an exception, or a
    failed outcome)."""
    return _reaches(record, LEVELS.index(level))


def _reaches(record: dict, floor: int) -> bool:
    if floor == LEVELS.index("error") and (record["exception"] or record["outcome"] in OUTCOMES_FAILED):
        return True
    return any(LEVELS.index(line["level"]) >= floor for line in record["logs"])


def _version_of(full: str, sha: str) -> int | None:
    """The version number whose code is `sha`, as the capability's route says now (a record
    that arrives after a later deploy has none)."""
    raw = get_redis().get(redis_keys.route(full))
    if not raw or raw == routes.TOMBSTONE:
        return None
    try:
        route = json.loads(raw)
    except ValueError:
        return None
    return route.get("ver") if route.get("sha") == sha else None


def _cut(text: str, max_bytes: int) -> tuple[str, bool]:
    data = text.encode()
    if len(data) <= max_bytes:
        return text, False
    return data[:max_bytes].decode(errors="ignore"), True


def _int(value) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def _float(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
