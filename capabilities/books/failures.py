"""Each capability's recent failures, kept in Redis for its owner to read.

`redis_keys.failures(full)` is a list of JSON records, newest first, capped at
SIGIL_FAILURES_KEPT: when, the status the caller got, Sigil's error code, the capability's
own message or exception line, how long the call took, the request id the caller saw
(`X-Request-Id`) and the version number that answered. The gateway writes one for every
failure it counts toward the breaker, inside the script that records the call
(stats.RECORD_CALLS), so it costs no round trip: failure_encode() is the record's one shape.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from sigil import redis_keys
from sigil.redis_client import get_redis

# The longest message kept: a first line of an exception, or the start of a 5xx body.
MESSAGE_MAX_CHARS = 500


@dataclass(frozen=True)
class Failure:
    at_epoch: float
    status: int
    code: str | None  # Sigil's error code; None for a 5xx the capability answered itself
    message: str
    duration_ms: float
    request_id: str
    version: int | None

    def as_dict(self) -> dict:
        return asdict(self)


def failure_encode(
    *,
    status: int,
    code: str | None,
    message: str,
    duration_ms: float,
    request_id: str,
    version: int | None,
    at_epoch: float | None = None,
) -> str:
    """One failure as the JSON the list holds (the script that records the call pushes it)."""
    return json.dumps(
        {
            "at": round(time.time() if at_epoch is None else at_epoch, 3),
            "status": status,
            "code": code,
            "message": message[:MESSAGE_MAX_CHARS],
            "ms": round(duration_ms, 3),
            "rid": request_id,
            "v": version,
        },
        separators=(",", ":"),
    )


def failures_list(*, full: str, limit: int | None = None) -> list[Failure]:
    """The recent failures of `full`, newest first (at most `limit`)."""
    end = -1 if limit is None else limit - 1
    return [_decode(raw) for raw in get_redis().lrange(redis_keys.failures(full), 0, end)]


def failures_forget(*, full: str) -> None:
    """Drop every record of `full` (it was removed). Idempotent."""
    get_redis().delete(redis_keys.failures(full))


def _decode(raw: bytes) -> Failure:
    data = json.loads(raw)
    return Failure(
        at_epoch=data["at"],
        status=data["status"],
        code=data["code"],
        message=data["message"],
        duration_ms=data["ms"],
        request_id=data["rid"],
        version=data["v"],
    )
