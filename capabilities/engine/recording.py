"""How a call ends: recorded once it reached the capability's code (its counters, breaker
outcome, failure record and access stamp: stats.CallRecord), counted as a refusal when Sigil
answered for it, or abandoned; and whatever way, its shares given back. AnswerBody streams the
capability's answer and records the call once the caller has it.

Records share script calls: a success waits up to RECORD_BATCH_SECONDS for the calls that end
meanwhile, and they are applied together, in the order they ended, in one round trip. A failure
is applied at once, with the records before it, before its caller has its answer: the breaker a
next call reads has seen it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import redis.asyncio as aioredis
from django.conf import settings

from capabilities.books import breaker, degraded_cache, failures, pager, stats
from capabilities.engine.access_log import log_access
from capabilities.engine.calls import Call
from capabilities.engine.offload import Offload
from capabilities.engine.shares import FairShares
from capabilities.engine.upstream import UpstreamResponse, UpstreamTimeout, UpstreamUnreachable
from capabilities.engine.values import CallRequest
from capabilities.runtimes import runtime_for
from capabilities.services.observability import breaker_changed
from sigil import redis_keys
from sigil.errors import REDIS_UNREACHABLE
from sigil.pipelined_redis import PipelinedRedis
from sigil.redis_client import get_redis

logger = logging.getLogger("capabilities.engine")

# How long a success's record may wait for others to share its script call (its counters are
# that much later in Redis), and how many records one call applies at most.
RECORD_BATCH_SECONDS = 0.005
RECORD_BATCH_MAX = 64


@dataclass(slots=True, eq=False)
class Recorder:
    """Records, counts and abandons the calls of one engine."""

    redis: aioredis.Redis
    warm_redis: PipelinedRedis  # the call's record, one script call
    offload: Offload
    shares: FairShares
    breaker: breaker.Breaker
    degraded_cache: degraded_cache.DegradedCache  # where AnswerBody keeps a last good answer
    failures_kept: int = field(init=False)
    access_log_length: int = field(init=False)
    waiting: list[stats.CallRecord] = field(init=False, default_factory=list)  # for their script call
    batch_timer: asyncio.TimerHandle | None = field(init=False, default=None)
    batches: set[asyncio.Task] = field(init=False, default_factory=set)  # script calls under way

    def __post_init__(self) -> None:
        self.failures_kept = settings.SIGIL_FAILURES_KEPT
        self.access_log_length = settings.SIGIL_ACCESS_PATTERN_MAX_CALLS

    async def finish(
        self, call: Call, *, status: int, ok: bool | None = None, code: str | None = None, message: str = ""
    ) -> None:
        """Record a call that reached the capability, answered `status` (ok unless 5xx, or
        as given), and give back its shares. A success's record joins the next batch; a
        failure's, or a half-open breaker's trial, is applied before this returns (with those
        waiting before it), and raises what an unreachable Redis raises."""
        call.finished = True
        call.recorded = True
        self.give_shares(call)
        ok = status < 500 if ok is None else ok
        now = time.time()
        latency_ms = (time.perf_counter() - call.started) * 1000
        failure = ""
        if not ok:
            failure = failures.failure_encode(
                status=status,
                code=code,
                message=message,
                duration_ms=latency_ms,
                request_id=call.request_id,
                version=call.version,
                at_epoch=now,
            )
        record = stats.CallRecord(
            call, at_epoch=now, latency_ms=latency_ms, status=status, ok=ok, code=code, failure=failure
        )
        self.waiting.append(record)
        if not ok or call.is_trial:
            await self.apply_waiting()
        elif len(self.waiting) >= RECORD_BATCH_MAX:
            self._apply_in_background()
        elif self.batch_timer is None:
            self.batch_timer = asyncio.get_running_loop().call_later(RECORD_BATCH_SECONDS, self._apply_in_background)

    async def apply_waiting(self) -> None:
        """Apply the records waiting, in one script call (stats.RECORD_CALLS); persist the
        breaker transitions they made through Celery."""
        if self.batch_timer is not None:
            self.batch_timer.cancel()
            self.batch_timer = None
        if not self.waiting:
            return
        # Built here rather than as each call ends: off the time of the call that ended last.
        waiting, self.waiting = self.waiting, []
        keys, args = [], []
        for record in waiting:
            keys += record.keys()
            args += record.args(
                rules=self.breaker, failures_kept=self.failures_kept, access_log_length=self.access_log_length
            )
        changes = await self.warm_redis.run_script(stats.RECORD_CALLS, keys, args)
        for record, change in zip(waiting, changes, strict=True):
            if change:
                await self.offload(breaker_changed, full=record.call.full, change=change, at_epoch=record.at_epoch)

    def _apply_in_background(self) -> None:
        task = asyncio.ensure_future(self._apply_logged())
        self.batches.add(task)
        task.add_done_callback(self.batches.discard)

    async def _apply_logged(self) -> None:
        calls = len(self.waiting)
        try:
            await self.apply_waiting()
        except REDIS_UNREACHABLE as exc:
            # Their callers have their answers; only these calls' counters are lost.
            logger.error("Redis unreachable: %d calls were not recorded: %s", calls, exc)

    async def close(self) -> None:
        """Apply what is waiting, and wait for the script calls under way (the engine stops)."""
        await self._apply_logged()
        if self.batches:
            await asyncio.gather(*self.batches, return_exceptions=True)

    def give_shares(self, call: Call) -> None:
        if call.holds_call_share:
            call.holds_call_share = False
            self.shares.give_call(call.caller)
        if call.body_size:
            self.shares.give_body(call.owner, call.body_size)
            call.body_size = 0

    async def count_answer(self, full: str | None, status: int, code: str | None) -> None:
        """Count an answer that was no call to the capability's code (see stats.answer_count),
        on the warm call's own connection: a burst of refusals opens no connection per answer."""
        try:
            await self.warm_redis.run_script(
                stats.ANSWER_COUNT, *stats.answer_count_call(full=full, status=status, code=code)
            )
        except REDIS_UNREACHABLE as exc:
            # The caller has its answer (likely `503 unavailable` for this same reason).
            logger.warning("Redis unreachable: a %s answer was not counted: %s", status, exc)

    async def abandon(self, call: Call) -> None:
        """A call that ended before the capability answered: give back what it holds."""
        call.finished = True
        self.give_shares(call)
        if not (call.is_trial or call.inflight_process):
            return
        pipe = self.redis.pipeline(transaction=False)
        if call.is_trial:
            pipe.delete(redis_keys.breaker_trial(call.full))
        if call.inflight_process:
            pager.pager_inflight_leave(call.full, process=call.inflight_process, pipe=pipe)
        try:
            await pipe.execute()
        except REDIS_UNREACHABLE as exc:
            logger.error("Redis unreachable: the call to %s left its counts: %s", call.full, exc)


class AnswerBody:
    """Streams the capability's body to the caller; records the call once it has been sent."""

    def __init__(self, recorder: Recorder, upstream: UpstreamResponse, call: Call, route, request: CallRequest) -> None:
        self.recorder = recorder
        self.upstream = upstream
        self.call = call
        self.route = route
        self.request = request
        self.ok = upstream.status < 500
        self.counts = True
        self.message = ""  # for a failure record: the start of a 5xx body, or why it was cut
        self.cache_target: str | None = None
        self.cache_answer: degraded_cache.CachedAnswer | None = None
        self.cache_chunks: list[bytes] = []
        self.cache_complete = False  # the whole body was read (not cut)

    def keep_for_cache(self, target: str, answer: degraded_cache.CachedAnswer) -> None:
        """Keep the body as it streams, to store it as the last good answer to `target`
        (capabilities that opted in: degraded_cache)."""
        self.cache_target, self.cache_answer = target, answer

    async def stream(self) -> AsyncIterator[bytes]:
        room = self.recorder.degraded_cache.max_body_bytes
        try:
            async for chunk in self.upstream.stream():
                if not self.ok and not self.message:
                    self.message = _first_line(chunk)
                if self.cache_answer is not None:
                    room -= len(chunk)
                    if room < 0:
                        self.cache_answer = None  # too large to keep: the call is not cached
                    else:
                        self.cache_chunks.append(chunk)
                yield chunk
            self.cache_complete = True
        except (UpstreamTimeout, UpstreamUnreachable) as exc:
            self.ok = False  # the capability stalled or broke mid-body; the caller sees a cut response
            self.message = f"failed while streaming its response: {exc}"
            logger.warning("%s failed while streaming its response: %s", self.call.full, exc)
            if isinstance(exc, UpstreamUnreachable):
                stopped = await stop_under(self.route, self.call.sent_at)
                # Cut because another call ran its process past a limit: not this one's failure.
                # Nor is a memory stop that came while this call was only sending its answer: the
                # process cannot say which call grew it, and one that had answered is the least
                # likely (its own growth would have stopped it before its answer began).
                self.counts = stopped is None or (stopped.culprit and stopped.reason != "memory")

    async def close(self, complete: bool) -> None:
        """Called once the caller has the last byte (or went away), so this bookkeeping is off
        the caller's latency."""
        recorder, call = self.recorder, self.call
        self.upstream.release()
        try:
            if self.counts:
                await recorder.finish(call, status=self.upstream.status, ok=self.ok, message=self.message)
            else:
                await recorder.abandon(call)
            if self.cache_answer is not None and self.cache_complete and complete and self.ok:
                answer = replace(self.cache_answer, body=b"".join(self.cache_chunks), stored_epoch=time.time())
                await recorder.offload(
                    recorder.degraded_cache.store, get_redis(), full=call.full, target=self.cache_target, answer=answer
                )
        except REDIS_UNREACHABLE as exc:
            # The caller has its answer; only this call's counters and breaker update are lost.
            logger.error("Redis unreachable: the call to %s was not recorded: %s", call.full, exc)
        finally:
            log_access(
                self.request, self.upstream.status, call.started, capability=call.full, page_in_ms=call.page_in_ms
            )


# A process that dies closes its connections a moment before the kernel shows it gone: a
# broken connection the runtime cannot yet explain is asked about again after these pauses.
STOP_RECHECK_PAUSES = (0.02, 0.05, 0.1)


async def stop_under(route, sent_at: float):
    """Why the runtime stopped the process that had the call sent at `sent_at` (its
    CallStopped), or None: the runtime failed some other way."""
    runtime = runtime_for(route.backend)
    for pause in (*STOP_RECHECK_PAUSES, None):
        stopped = runtime.call_stopped(slot=route.slot, tenant=route.agent, sent_at=sent_at)
        if stopped is not None or pause is None:
            return stopped
        await asyncio.sleep(pause)


def _first_line(chunk: bytes) -> str:
    lines = chunk[: failures.MESSAGE_MAX_CHARS].decode(errors="replace").strip().splitlines()
    return lines[0] if lines else ""
