"""Asynchronous calls (`Prefer: respond-async`): accepted at once, run in Celery through the
gateway's own path, their result kept for the caller and sent to its callback URL.

One Redis hash per call, `sigil:async:{id}`, is its execution record: the request as the
gateway received it (less the caller's credentials), then `running` with a count of
attempts, then `done` with the result. The record makes the task safe to run again: a
worker lost mid-call leaves it `running`, the redelivered task runs the call again (a call
cut by a lost worker may reach the capability twice), and the first result recorded is the
one kept and delivered; a task that finds its call `done` only makes sure its callback is
queued.
"""

from __future__ import annotations

import base64
import io
import json
import time
import uuid
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from agents import egress
from agents.models import Agent
from agents.tokens import Principal
from capabilities.upstream import HOP_BY_HOP
from sigil_site.errors import InvalidRequest, NotFound, RateLimited
from sigil_site.redis_client import get_redis

ACCEPTED, RUNNING, DONE = "accepted", "running", "done"
CALLBACK_EVENT = "call.completed"


def record_key(call_id: str) -> str:
    return f"sigil:async:{call_id}"


def status_url(call_id: str) -> str:
    return f"/_api/calls/{call_id}"


def pending_key(agent_name: str) -> str:
    """The agent's calls accepted and not yet run: call id → when it was accepted."""
    return f"sigil:async:pending:{agent_name}"


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
    path: str,
    query: str,
    headers: dict[str, str],
    body: bytes,
    callback_url: str | None,
) -> AcceptedCall:
    """Keep a call for Celery to run and queue it. Raises InvalidRequest for a callback URL
    that is not http(s) or names a private address (agents.egress). Not idempotent: each accepted call runs once."""
    if callback_url is not None and (refusal := egress.callback_refusal(callback_url, resolve=False)):
        raise InvalidRequest(refusal)
    call_id = uuid.uuid4().hex
    key = record_key(call_id)
    redis = get_redis()
    # One agent's burst of accepted calls must not fill the workers every agent shares.
    now, life = time.time(), settings.SIGIL_ASYNC_RESULT_TTL_SECONDS
    limit = settings.SIGIL_ASYNC_MAX_PENDING_PER_AGENT
    if not redis.eval(_ADMIT, 1, pending_key(caller), call_id, f"{now:.6f}", f"{now - life:.6f}", limit, life):
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
            "path": path,
            "query": query,
            "headers": json.dumps(headers),
            "body": body,
            "callback": callback_url or "",
            "accepted_at": f"{time.time():.6f}",
            "attempts": 0,
        },
    )
    # A call still queued when this runs out is dropped: nobody could fetch its result anyway.
    pipe.expire(key, settings.SIGIL_ASYNC_RESULT_TTL_SECONDS)
    pipe.execute()
    from capabilities.tasks import capability_async_call as capability_async_call_task

    capability_async_call_task.apply_async(kwargs={"call_id": call_id}, queue=settings.SIGIL_ASYNC_QUEUE)
    return AcceptedCall(call_id=call_id, status_url=status_url(call_id))


# KEYS: the record. ARGV: status, headers (JSON), body, truncated (0/1), finished at, TTL s.
# Records the first result only; returns 1 when this one was recorded, 0 when one was
# already, -1 when the record has expired.
_RECORD_RESULT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'state') == 'done' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'result_status', ARGV[1], 'result_headers', ARGV[2],
  'result_body', ARGV[3], 'truncated', ARGV[4], 'finished_at', ARGV[5])
redis.call('HDEL', KEYS[1], 'body', 'headers')
redis.call('EXPIRE', KEYS[1], ARGV[6])
return 1
"""


def async_call_run(*, call_id: str) -> None:
    """Run an accepted call through the gateway as its caller, record its result, queue its
    callback. Idempotent: a call already done is not run again, and its callback is queued
    once. A record that has expired is dropped."""
    redis = get_redis()
    key = record_key(call_id)
    record = {k.decode(): v for k, v in redis.hgetall(key).items()}
    if not record:
        return
    if record["state"].decode() != DONE:
        pipe = redis.pipeline(transaction=True)
        pipe.hset(key, "state", RUNNING)
        pipe.hincrby(key, "attempts", 1)
        pipe.execute()
        result = _run_through_gateway(record)
        recorded = redis.eval(
            _RECORD_RESULT,
            1,
            key,
            result.status,
            json.dumps(result.headers),
            result.body,
            int(result.truncated),
            f"{time.time():.6f}",
            settings.SIGIL_ASYNC_RESULT_TTL_SECONDS,
        )
        redis.zrem(pending_key(record["agent"].decode()), call_id)
        if recorded == -1:
            return
    _queue_callback(call_id)


def async_call_get(*, principal: Principal, call_id: str) -> AsyncCall:
    """The call as its caller sees it. Raises NotFound for an unknown or expired call, and
    for another agent's (whose calls are not revealed to exist)."""
    record = {k.decode(): v for k, v in get_redis().hgetall(record_key(call_id)).items()} if call_id else {}
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


def _queue_callback(call_id: str) -> None:
    """Queue the signed POST of the result to the caller's callback URL, once per call."""
    redis = get_redis()
    key = record_key(call_id)
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
    from agents.tasks import agent_webhook_deliver as agent_webhook_deliver_task

    # Queued, then marked: a worker lost in between queues it again (at least once; the
    # delivery id lets the receiver drop a repeat), never not at all.
    agent_webhook_deliver_task.apply_async(
        kwargs={"agent_id": agent.pk, "delivery": delivery, "url": callback}, queue=settings.SIGIL_ASYNC_QUEUE
    )
    redis.hset(key, "callback_queued", 1)


def _run_through_gateway(record: dict[str, bytes]) -> CallResult:
    """The gateway's own answer to the call, as its caller would have had it, the body kept
    up to SIGIL_ASYNC_RESULT_MAX_BYTES (the rest is read and dropped, so the call ends and
    is recorded as any other)."""
    from capabilities.gateway import ACCEPTED_CALLER

    body = record.get("body", b"")
    environ = {
        "REQUEST_METHOD": record["method"].decode(),
        "PATH_INFO": record["path"].decode(),
        "QUERY_STRING": record["query"].decode(),
        "SERVER_NAME": "sigil-async",
        "SERVER_PORT": "0",
        "REMOTE_ADDR": "127.0.0.1",
        "wsgi.input": io.BytesIO(body),
        ACCEPTED_CALLER: record["token_hash"].decode(),
    }
    if body:
        environ["CONTENT_LENGTH"] = str(len(body))
    for name, value in json.loads(record["headers"]).items():
        if name == "content-type":
            environ["CONTENT_TYPE"] = value
        else:
            environ["HTTP_" + name.upper().replace("-", "_")] = value
    answered: dict = {}

    def start_response(status, headers, exc_info=None):
        answered["status"], answered["headers"] = status, headers

    limit = settings.SIGIL_ASYNC_RESULT_MAX_BYTES
    kept, truncated = bytearray(), False
    response = _gateway()(environ, start_response)
    try:
        for chunk in response:
            room = limit - len(kept)
            if len(chunk) > room:
                truncated = True
            kept += chunk[: max(0, room)]
    finally:
        if hasattr(response, "close"):
            response.close()
    headers = [(k, v) for k, v in answered["headers"] if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"]
    return CallResult(status=int(answered["status"][:3]), headers=headers, body=bytes(kept), truncated=truncated)


_held_gateway: list = []


def _gateway():
    """The gateway of this worker process, built again when its runtime is (a test's settings)."""
    from capabilities.gateway import Gateway
    from capabilities.runtimes import get_runtime

    if not _held_gateway or _held_gateway[0].runtime is not get_runtime():
        _held_gateway[:] = [Gateway()]
    return _held_gateway[0]
