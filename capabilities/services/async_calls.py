"""Asynchronous calls (`Prefer: respond-async`): accepted at once, run by the engine's
runners (capabilities/engine/runner.py) in the web processes, their result kept for the caller
and sent to its callback URL.

One Redis hash per call, `redis_keys.async_call(id)`, is its execution record: the request as
the engine received it (less the caller's credentials), then `running` with a count of
attempts, then `done` with the result. An accepted call waits in `ASYNC_QUEUE` until a runner
takes it into its own list (`async_taken`); a runner that dies leaves its calls there, and
another runner puts them back once the dead one's lease has run out: a call cut that way may
reach the capability twice, and the first result recorded is the one kept and delivered.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from agents import egress, jobs
from agents.models import Agent
from agents.tokens import Principal
from sigil import redis_keys
from sigil.errors import InvalidRequest, NotFound, RateLimited
from sigil.redis_client import get_redis

ACCEPTED, RUNNING, DONE = "accepted", "running", "done"
CALLBACK_EVENT = "call.completed"
# What the 202 tells the caller to expect: a runner takes a call within about this long.
ETA_SECONDS = 1


def status_url(call_id: str) -> str:
    return f"/_api/calls/{call_id}"


# KEYS: the agent's pending set. ARGV: call id, now, the oldest acceptance still counted (a
# call older than the records' life has expired unrun), the limit, the set's life (s).
# Returns 1 when the call is admitted, 0 when the agent has the limit of calls pending.
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


@dataclass(frozen=True)
class AcceptedCall:
    call_id: str
    status_url: str
    eta_seconds: int = ETA_SECONDS


@dataclass(frozen=True)
class CallResult:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    truncated: bool

    def as_json(self) -> dict:
        """The result in a JSON document: the body as text when it is UTF-8, else base64."""
        try:
            body, encoding = self.body.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            body, encoding = base64.b64encode(self.body).decode(), "base64"
        return {
            "status": self.status,
            "headers": dict(self.headers),
            "body": body,
            "body_encoding": encoding,
            "truncated": self.truncated,
        }


@dataclass(frozen=True)
class AsyncCall:
    call_id: str
    capability: str
    state: str
    attempts: int
    result: CallResult | None


def async_call_accept(
    *,
    caller: str,
    full: str,
    token_hash: str,
    method: str,
    rest: str,
    query: str,
    headers: dict[str, str],
    body: bytes,
    callback_url: str | None,
    request_id: str,
) -> AcceptedCall:
    """Keep a call for the runners and queue it. Raises InvalidRequest for a callback URL that
    is not http(s) or names a private address (agents.egress), RateLimited when the agent has
    its limit of calls waiting. Not idempotent: each accepted call runs once."""
    if callback_url is not None and (refusal := egress.callback_refusal(callback_url, resolve=False)):
        raise InvalidRequest(refusal)
    call_id = uuid.uuid4().hex
    key = redis_keys.async_call(call_id)
    redis = get_redis()
    # One agent's burst of accepted calls must not fill the runners every agent shares.
    now, life = time.time(), settings.SIGIL_ASYNC_RESULT_TTL_SECONDS
    limit = settings.SIGIL_ASYNC_MAX_PENDING_PER_AGENT
    if not redis.eval(
        _ADMIT, 1, redis_keys.async_pending(caller), call_id, f"{now:.6f}", f"{now - life:.6f}", limit, life
    ):
        raise RateLimited(
            f"{caller} has {limit} asynchronous calls not yet run; fetch their results or wait", retry_after=1
        )
    pipe = redis.pipeline(transaction=True)
    pipe.hset(
        key,
        mapping={
            "state": ACCEPTED,
            "agent": caller,
            "full": full,
            "token_hash": token_hash,
            "method": method,
            "rest": rest,
            "query": query,
            "headers": json.dumps(headers),
            "body": body,
            "callback": callback_url or "",
            "accepted_at": f"{now:.6f}",
            "attempts": 0,
            # The capability gets the id the 202 carried, so both name the same call.
            "request_id": request_id,
        },
    )
    # A call still queued when this runs out is dropped: nobody could fetch its result anyway.
    pipe.expire(key, life)
    pipe.lpush(redis_keys.ASYNC_QUEUE, call_id)
    pipe.execute()
    return AcceptedCall(call_id=call_id, status_url=status_url(call_id))


# KEYS: the record. ARGV: status, headers (JSON), body, truncated (0/1), finished at, TTL s.
# Records the first result only; returns 1 when this one was recorded, 0 when one was
# already, -1 when the record has expired.
# A call its runner could not finish (Sigil's own failure, such as Redis gone mid-call) goes
# back to the queue's far end, where the oldest wait; only if its runner still held it (a
# restarted Redis may have lost the take, and with it the call is in the queue already).
# KEYS: the runner's list, the queue; ARGV: the call's id.
PUT_BACK = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

RECORD_RESULT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'state') == 'done' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'result_status', ARGV[1], 'result_headers', ARGV[2],
  'result_body', ARGV[3], 'truncated', ARGV[4], 'finished_at', ARGV[5])
redis.call('HDEL', KEYS[1], 'body', 'headers')
redis.call('EXPIRE', KEYS[1], ARGV[6])
return 1
"""


def async_call_get(*, principal: Principal, call_id: str) -> AsyncCall:
    """The call as its caller sees it. Raises NotFound for an unknown or expired call, and
    for another agent's (whose calls are not revealed to exist)."""
    record = {k.decode(): v for k, v in get_redis().hgetall(redis_keys.async_call(call_id)).items()} if call_id else {}
    if not record or record["agent"].decode() != principal.agent_name:
        raise NotFound(f"no call {call_id}")
    return _call_from_record(call_id, record)


def _call_from_record(call_id: str, record: dict[str, bytes]) -> AsyncCall:
    state = record["state"].decode()
    result = None
    if state == DONE:
        result = CallResult(
            status=int(record["result_status"]),
            headers=[tuple(pair) for pair in json.loads(record["result_headers"])],
            body=record.get("result_body", b""),
            truncated=record.get("truncated") == b"1",
        )
    return AsyncCall(
        call_id=call_id,
        capability=record["full"].decode(),
        state=state,
        attempts=int(record.get("attempts", 0)),
        result=result,
    )


def async_call_done(*, call_id: str, agent: str) -> None:
    """What follows a call's recorded result: it no longer counts as waiting, and its callback
    is queued. Idempotent."""
    get_redis().zrem(redis_keys.async_pending(agent), call_id)
    _queue_callback(call_id)


def _queue_callback(call_id: str) -> None:
    """Queue the signed POST of the result to the caller's callback URL, once per call."""
    redis = get_redis()
    key = redis_keys.async_call(call_id)
    record = {k.decode(): v for k, v in redis.hgetall(key).items()}
    callback = record.get("callback", b"").decode()
    if not callback or record.get("callback_queued"):
        return
    call = _call_from_record(call_id, record)
    agent = Agent.objects.filter(name=record["agent"].decode()).first()
    if agent is None:
        return
    delivery = {
        "id": call_id,  # the same on every retry, so that a receiver can drop a repeat
        "event": CALLBACK_EVENT,
        "agent": agent.name,
        "sent_at": timezone.now().isoformat(),
        "call": call_id,
        "capability": call.capability,
        "result": call.result.as_json(),
    }
    # Queued, then marked: a worker lost in between queues it again (at least once; the
    # delivery id lets the receiver drop a repeat), never not at all.
    jobs.agent_callback_deliver.delay(agent_id=agent.pk, delivery=delivery, url=callback)
    redis.hset(key, "callback_queued", 1)
