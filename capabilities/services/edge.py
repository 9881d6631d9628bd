"""The edge's state in Workers KV (docs/cloudflare.md, "The edge's state"): its namespace,
provisioned with the runtime; the publisher, which beat runs every
SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS, writing every key marked dirty (sigil/edge_state.py) as
the database has it, in bulk; the reconcile, which beat runs every
SIGIL_EDGE_RECONCILE_INTERVAL_SECONDS, marking what KV holds that the database does not say;
and the publisher's standing, for the owner.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from django.conf import settings

from capabilities import edge
from capabilities.runtimes import get_runtime
from capabilities.runtimes.cloudflare import KvPair, NamedKv
from capabilities.runtimes.errors import RuntimeFailure
from sigil import redis_keys
from sigil.edge_state import ROUTE_PREFIX, TOKEN_PREFIX
from sigil.leases import Lease
from sigil.redis_client import get_redis

logger = logging.getLogger(__name__)

# The keys a publisher took (redis_keys.EDGE_PUBLISHING) are taken from EDGE_DIRTY in one step;
# they are written, or given back to it when the write fails; a publisher that died meanwhile
# leaves them for the next (one publisher at a time, EDGE_PUBLISHER_LEASE).
# /_health warns of the publisher once this many runs in a row failed.
FAILURES_WARNED = 3


def edge_kv() -> NamedKv | None:
    """The edge's KV namespace (SIGIL_EDGE_KV_TITLE), or None when the edge is off or the
    runtime is not on Cloudflare. No I/O."""
    runtime = get_runtime()
    if not settings.SIGIL_EDGE or not runtime.on_cloudflare:
        return None
    return runtime.kv_namespace(settings.SIGIL_EDGE_KV_TITLE)


def edge_provision() -> list[str]:
    """Create the edge's KV namespace if it is missing (with the edge on, on Cloudflare);
    return what was done. Idempotent. Raises RuntimeUnavailable, RuntimeRejected."""
    kv = edge_kv()
    if kv is None or not kv.provision():
        return []
    return [f"created the edge's KV namespace {kv.title} ({kv.id})"]


@dataclass(frozen=True)
class Published:
    """What one run of the publisher did: `written` keys written, `failed` why it wrote none
    (its keys are marked again)."""

    written: int
    failed: str | None = None


def edge_publish() -> Published | None:
    """Write every key marked dirty to the edge's KV, with its value as the database (and the
    breakers in Redis) have it now, in as few bulk writes as Cloudflare takes (10,000 pairs
    each): tombstones expire after a day, every value carries its digest. None when there was
    nothing to do (the edge off, nothing marked, another publisher at work).

    A write Cloudflare refuses or that fails gives every key taken back to the marked ones,
    for the next run, and is recorded in the publisher's standing (`edge_standing`); no
    runtime failure is raised. Idempotent: a key written twice holds the same value. Safe to
    overlap with itself: one publisher at a time, under a lease.
    """
    kv = edge_kv()
    redis = get_redis()
    if kv is None or not redis.exists(redis_keys.EDGE_DIRTY, redis_keys.EDGE_PUBLISHING):
        return None
    lease = Lease(redis_keys.EDGE_PUBLISHER_LEASE, hold_seconds=settings.CELERY_TASK_SOFT_TIME_LIMIT, blocking=False)
    if not lease.acquire():
        return None
    try:
        return _publish(kv)
    finally:
        if lease.owned():
            lease.release()


def _publish(kv: NamedKv) -> Published:
    redis = get_redis()
    pipe = redis.pipeline(transaction=True)
    pipe.sunionstore(redis_keys.EDGE_PUBLISHING, [redis_keys.EDGE_PUBLISHING, redis_keys.EDGE_DIRTY])
    pipe.delete(redis_keys.EDGE_DIRTY)
    pipe.smembers(redis_keys.EDGE_PUBLISHING)
    taken = sorted(key.decode() for key in pipe.execute()[-1])
    values = edge.edge_values(taken, now_epoch=time.time())
    pairs = [
        KvPair(
            key,
            value,
            expiration_ttl=edge.TOMBSTONE_TTL_SECONDS if edge.is_tombstone(value) else None,
            metadata={"sha": edge.digest(value)},
        )
        for key, value in values.items()
    ]
    try:
        unwritten = kv.bulk_put(pairs) if pairs else []
    except RuntimeFailure as exc:
        pipe = redis.pipeline(transaction=True)
        pipe.sunionstore(redis_keys.EDGE_DIRTY, [redis_keys.EDGE_DIRTY, redis_keys.EDGE_PUBLISHING])
        pipe.delete(redis_keys.EDGE_PUBLISHING)
        pipe.hset(redis_keys.EDGE_STANDING, mapping={"failed_at": time.time(), "error": str(exc)})
        pipe.hincrby(redis_keys.EDGE_STANDING, "failures", 1)
        pipe.execute()
        logger.warning("publishing %d keys to the edge failed; they are published again next time: %s", len(pairs), exc)
        return Published(written=0, failed=str(exc))
    pipe = redis.pipeline(transaction=True)
    pipe.delete(redis_keys.EDGE_PUBLISHING)
    if unwritten:  # Cloudflare's word: "they should be retried"
        pipe.sadd(redis_keys.EDGE_DIRTY, *unwritten)
    written = len(pairs) - len(unwritten)
    pipe.hset(redis_keys.EDGE_STANDING, mapping={"published_at": time.time(), "published": written, "failures": 0})
    pipe.execute()
    return Published(written=written)


def edge_reconcile() -> int | None:
    """Compare what the edge's KV holds (a listing of `tok:` and `route:`, each key with its
    value's digest) with what the database says each key holds, and mark the keys that differ
    for the publisher: a value changed or lost behind Sigil's back, a key Sigil never wrote, a
    write that was lost. A key KV lacks whose value is a tombstone needs nothing (a missing
    key sends the edge to the origin, which refuses the same). Returns how many keys were
    marked; None with the edge off.

    Idempotent. Raises RuntimeUnavailable when KV cannot be listed.
    """
    kv = edge_kv()
    if kv is None:
        return None
    listed = {
        key["name"]: (key.get("metadata") or {}).get("sha")
        for prefix in (TOKEN_PREFIX, ROUTE_PREFIX)
        for key in kv.keys(prefix=prefix)
    }
    expected = edge.edge_values_all(now_epoch=time.time())
    differ = [key for key, sha in listed.items() if sha != edge.digest(expected.get(key, edge.TOMBSTONE))]
    differ += [key for key, value in expected.items() if key not in listed and not edge.is_tombstone(value)]
    if differ:
        get_redis().sadd(redis_keys.EDGE_DIRTY, *differ)
        logger.info("the edge's KV differs from the database in %d keys; marked to publish them again", len(differ))
    return len(differ)


@dataclass(frozen=True)
class EdgeStanding:
    """The publisher as the owner sees it: whether the edge is on, keys waiting to be written,
    its last publish and its last failure (epoch seconds), and the runs that failed since it
    last published."""

    edge_on: bool
    waiting: int
    published_at: float | None
    published: int
    failed_at: float | None
    error: str
    failures_in_a_row: int


def edge_standing() -> EdgeStanding:
    """The publisher's standing. Reads Redis only."""
    redis = get_redis()
    pipe = redis.pipeline(transaction=False)
    pipe.scard(redis_keys.EDGE_DIRTY)
    pipe.scard(redis_keys.EDGE_PUBLISHING)
    pipe.hgetall(redis_keys.EDGE_STANDING)
    dirty, publishing, raw = pipe.execute()
    standing = {name.decode(): value.decode() for name, value in raw.items()}
    return EdgeStanding(
        edge_on=settings.SIGIL_EDGE,
        waiting=dirty + publishing,  # a key in both is counted twice: it is written once
        published_at=float(standing["published_at"]) if "published_at" in standing else None,
        published=int(standing.get("published", 0)),
        failed_at=float(standing["failed_at"]) if "failed_at" in standing else None,
        error=standing.get("error", ""),
        failures_in_a_row=int(standing.get("failures", 0)),
    )


def edge_warning() -> str | None:
    """What /_health warns of when the publisher keeps failing (the edge then decides by an
    older state), else None."""
    if not settings.SIGIL_EDGE:
        return None
    standing = edge_standing()
    if standing.failures_in_a_row < FAILURES_WARNED:
        return None
    return (
        f"the edge's state has not been published for {standing.failures_in_a_row} runs in a row "
        f"({standing.waiting} keys waiting): {standing.error}"
    )
