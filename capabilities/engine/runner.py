"""The runners of accepted asynchronous calls: tasks on the engine's event loop, in every web
process (and in `manage.py runcalls`), taking calls from the queue the 202 put them in
(capabilities/services/async_calls.py).

A call waiting on its capability holds no thread and no Celery worker: housekeeping and
deploys never wait behind agents' calls. Each process runs at most SIGIL_ASYNC_RUNNERS calls
at once, at most SIGIL_ASYNC_RUNNERS_PER_AGENT of one agent's (the rest of that agent's wait
their turn while other agents' calls run), and a call that runs past
SIGIL_ASYNC_CALL_MAX_SECONDS ends with a `504 timeout` result, never `running` for good. A
transient failure in Sigil's own hands (a `503 unavailable` it answered) is tried again
within that time, no sooner than its Retry-After, before a result is kept.

A runner holds a lease in Redis while it lives; the calls it took wait in a list of its own,
and a runner that finds another's lease lapsed (its process died) puts that one's calls back
in the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from django.conf import settings

from capabilities import names
from capabilities.engine.answers import error_answer
from capabilities.engine.engine import Engine
from capabilities.engine.upstream import HOP_BY_HOP
from capabilities.engine.values import CallRequest
from capabilities.services import async_calls
from sigil import leases, redis_keys
from sigil.errors import InternalError, SigilError, Timeout
from sigil.redis_client import SOCKET_TIMEOUT_SECONDS
from sigil.request_id import new_request_id, set_request_id

logger = logging.getLogger(__name__)

# A transient failure of Sigil's own is tried again this many times, this far apart (or as far
# as its Retry-After asks).
TRANSIENT_TRIES = 3
TRANSIENT_PAUSE_SECONDS = 1.0
# A call whose runs Sigil failed to finish this many times (its runner killed mid-call, or a
# failure of Sigil's own each time) ends with a 500 instead of running again.
MAX_ATTEMPTS = 5


class AsyncCallRunner:
    """The runners of one process. `engine_of` returns the process's current engine."""

    def __init__(self, engine_of: Callable[[], Engine], *, runner_id: str | None = None) -> None:
        self.engine_of = engine_of
        self.runner_id = runner_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.running: defaultdict[str, int] = defaultdict(int)
        self.deferred: defaultdict[str, deque[str]] = defaultdict(deque)
        self.tasks: set[asyncio.Task] = set()
        self.room = asyncio.Event()
        # The runner's own connections for its queue and lease (a blocking take holds one),
        # apart from the engine's, which is built only when a call runs.
        self.redis = None

    async def run(self) -> None:
        """Take and run calls until cancelled; then let go of the lease so that another runner
        takes back at once what this one had not finished."""
        self.redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=SOCKET_TIMEOUT_SECONDS)
        lease = asyncio.create_task(self.keep_lease())
        try:
            while True:
                try:
                    await self.take_one()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("the async call runner failed to take a call; trying again")
                    await asyncio.sleep(1)
        finally:
            lease.cancel()
            for task in list(self.tasks):
                task.cancel()
            with contextlib.suppress(Exception):
                await self.redis.delete(redis_keys.async_runner(self.runner_id))
            await self.redis.aclose()

    async def take_one(self) -> None:
        capacity = settings.SIGIL_ASYNC_RUNNERS
        if len(self.tasks) >= capacity:
            self.room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.room.wait(), timeout=1)
            return
        if self.start_deferred():
            return
        redis = self.redis
        taken = await redis.blmove(redis_keys.ASYNC_QUEUE, redis_keys.async_taken(self.runner_id), 1, "RIGHT", "LEFT")
        if taken is None:
            return
        call_id = taken.decode()
        if len(self.tasks) >= settings.SIGIL_ASYNC_RUNNERS:  # the room went while this one waited
            await redis.lrem(redis_keys.async_taken(self.runner_id), 1, call_id)
            await redis.rpush(redis_keys.ASYNC_QUEUE, call_id)  # back where the oldest wait
            return
        agent = await redis.hget(redis_keys.async_call(call_id), "agent")
        if agent is None:  # expired while it waited
            await redis.lrem(redis_keys.async_taken(self.runner_id), 1, call_id)
            return
        agent = agent.decode()
        if self.running[agent] >= settings.SIGIL_ASYNC_RUNNERS_PER_AGENT:
            self.deferred[agent].append(call_id)  # its turn comes when one of the agent's ends
            return
        self.start(call_id, agent)

    def start_deferred(self) -> bool:
        for agent, waiting in list(self.deferred.items()):
            if waiting and self.running[agent] < settings.SIGIL_ASYNC_RUNNERS_PER_AGENT:
                self.start(waiting.popleft(), agent)
                if not waiting:
                    del self.deferred[agent]
                return True
        return False

    def start(self, call_id: str, agent: str) -> None:
        self.running[agent] += 1
        task = asyncio.create_task(self.run_taken(call_id, agent))
        self.tasks.add(task)

    async def run_taken(self, call_id: str, agent: str) -> None:
        engine = self.engine_of()
        try:
            try:
                await execute(engine, call_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Sigil's own failure (Redis gone mid-call, say): this runner's lease lives on,
                # so no other runner would take the call back; it goes back itself.
                logger.exception("asynchronous call %s failed in its runner; it goes back to the queue", call_id)
                await self.until_redis_answers(
                    lambda: self.redis.eval(
                        async_calls.PUT_BACK, 2, redis_keys.async_taken(self.runner_id), redis_keys.ASYNC_QUEUE, call_id
                    )
                )
            else:
                await self.until_redis_answers(
                    lambda: self.redis.lrem(redis_keys.async_taken(self.runner_id), 1, call_id)
                )
        finally:
            self.running[agent] -= 1
            if not self.running[agent]:
                del self.running[agent]
            self.tasks.discard(asyncio.current_task())
            self.room.set()

    async def until_redis_answers(self, command: Callable[[], Awaitable]) -> None:
        """Run a step of the runner's books until Redis takes it: a step lost while Redis is
        down or restarting would leave a call taken for as long as this runner lives."""
        while True:
            try:
                await command()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("the async call runner could not reach Redis (%s); trying again", exc)
                await asyncio.sleep(TRANSIENT_PAUSE_SECONDS)

    async def keep_lease(self) -> None:
        while True:
            # A lease as long as every shared mark's (sigil/leases.py), renewed every third of it.
            seconds = leases.lease_seconds()
            try:
                await self.redis.set(redis_keys.async_runner(self.runner_id), 1, ex=max(1, round(seconds)))
                await reclaim(self.redis, self.runner_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("the async call runner could not renew its lease: %s", exc)
            await asyncio.sleep(seconds / 3)


async def reclaim(redis, own_id: str) -> int:
    """Put back in the queue the calls of runners whose lease has lapsed; how many."""
    moved = 0
    prefix = redis_keys.async_taken("")
    async for key in redis.scan_iter(match=prefix + "*", count=200):
        other = key.decode()[len(prefix) :]
        if other == own_id or await redis.exists(redis_keys.async_runner(other)):
            continue
        # Back at the queue's far end, where the oldest calls wait: they were taken first.
        while await redis.lmove(key, redis_keys.ASYNC_QUEUE, "RIGHT", "RIGHT") is not None:
            moved += 1
    if moved:
        logger.warning("put back %d asynchronous calls whose runner stopped", moved)
    return moved


async def execute(engine: Engine, call_id: str) -> None:
    """Run one accepted call and record its result, then what follows it (its callback).
    Idempotent: a call already done is not run again. A record that has expired is dropped."""
    redis = engine.redis
    key = redis_keys.async_call(call_id)
    record = {k.decode(): v for k, v in (await redis.hgetall(key)).items()}
    if not record:
        return
    if record["state"].decode() != async_calls.DONE:
        if int(record.get("attempts", b"0")) >= MAX_ATTEMPTS:
            result = gave_up(record)
        else:
            pipe = redis.pipeline(transaction=True)
            pipe.hset(key, "state", async_calls.RUNNING)
            pipe.hincrby(key, "attempts", 1)
            await pipe.execute()
            result = await run_within_time(engine, record)
        recorded = await redis.eval(
            async_calls.RECORD_RESULT,
            1,
            key,
            result.status,
            json.dumps(result.headers),
            result.body,
            int(result.truncated),
            f"{time.time():.6f}",
            settings.SIGIL_ASYNC_RESULT_TTL_SECONDS,
        )
        if recorded == -1:
            return
    await engine.offload(async_calls.async_call_done, call_id=call_id, agent=record["agent"].decode())


def gave_up(record: dict[str, bytes]) -> async_calls.CallResult:
    """The result of a call that Sigil failed to finish MAX_ATTEMPTS times: its own failure,
    logged under the call's request id."""
    request_id = record.get("request_id", b"").decode() or new_request_id()
    logger.error("[%s] asynchronous call of %s ended after %d failed runs", request_id, record["full"], MAX_ATTEMPTS)
    return sigils_answer(InternalError(request_id=request_id), request_id)


def sigils_answer(error: SigilError, request_id: str) -> async_calls.CallResult:
    """The result of a call that Sigil answered itself, in the contract's envelope."""
    answer = error_answer(error)
    answer.headers.append(("X-Request-Id", request_id))
    return async_calls.CallResult(answer.status, _kept_headers(answer.headers), answer.body, False)


async def run_within_time(engine: Engine, record: dict[str, bytes]) -> async_calls.CallResult:
    """The call's result, its own answer or Sigil's: a transient refusal of Sigil's is tried
    again while time is left, and a call past SIGIL_ASYNC_CALL_MAX_SECONDS is a 504."""
    limit = settings.SIGIL_ASYNC_CALL_MAX_SECONDS
    deadline = time.monotonic() + limit
    request_id = record.get("request_id", b"").decode() or new_request_id()
    set_request_id(request_id)
    try:
        for attempt in range(TRANSIENT_TRIES):
            result = await asyncio.wait_for(run_call(engine, record, request_id), timeout=deadline - time.monotonic())
            transient = result.status == 503 and _sigil_code(result) == "unavailable"
            # Not before Sigil said there would be room (a spent API budget says when): sooner,
            # the call would only be refused again.
            pause = max(TRANSIENT_PAUSE_SECONDS, _retry_after(result))
            if not transient or attempt + 1 == TRANSIENT_TRIES or time.monotonic() + pause > deadline:
                return result
            await asyncio.sleep(pause)
    except TimeoutError:
        full = record["full"].decode()
        return sigils_answer(
            Timeout(f"{full} did not finish within {limit:g} s, the longest an asynchronous call runs"), request_id
        )
    return result


async def run_call(engine: Engine, record: dict[str, bytes], request_id: str) -> async_calls.CallResult:
    """The engine's answer to the call, as its caller would have had it, the body kept up to
    SIGIL_ASYNC_RESULT_MAX_BYTES (the rest is read and dropped, so the call ends and is
    recorded as any other)."""
    agent, name = names.split_full_name(record["full"].decode())
    body = record.get("body", b"")
    request = CallRequest(
        agent=agent,
        name=name,
        rest=record["rest"].decode(),
        method=record["method"].decode(),
        query=record["query"].decode(),
        headers=json.loads(record["headers"]),
        body=body,
        length=len(body) or None,
        request_id=request_id,
        accepted_token_hash=record["token_hash"].decode(),
    )
    answer = await engine.call(request)
    limit = settings.SIGIL_ASYNC_RESULT_MAX_BYTES
    kept, truncated, complete = bytearray(), False, False
    try:
        async for chunk in answer.chunks():
            truncated = truncated or len(chunk) > limit - len(kept)
            kept += chunk[: max(0, limit - len(kept))]
        complete = True
    finally:
        await answer.close(complete=complete)
    return async_calls.CallResult(answer.status, _kept_headers(answer.headers), bytes(kept), truncated)


def run_now(*, call_id: str) -> None:
    """Run one accepted call now, outside the runners (an owner's command, a test), on an
    engine of its own. Idempotent: a call already done is not run again, and its callback is
    queued once. A record that has expired is dropped."""

    async def run() -> None:
        engine = Engine()
        try:
            await execute(engine, call_id)
            await engine.redis.lrem(redis_keys.ASYNC_QUEUE, 0, call_id)
        finally:
            await engine.aclose()

    asyncio.run(run())


def _kept_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"]


def _retry_after(result: async_calls.CallResult) -> float:
    """The seconds Sigil's refusal asked to wait (its Retry-After), 0 when it named none."""
    for name, value in result.headers:
        if name.lower() == "retry-after" and value.isdigit():
            return float(value)
    return 0.0


def _sigil_code(result: async_calls.CallResult) -> str | None:
    if any(k.lower() == "x-sigil-capability" for k, _ in result.headers):
        return None  # the capability's own answer
    try:
        return json.loads(result.body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
