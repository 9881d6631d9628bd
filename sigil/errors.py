"""Sigil's error contract: SigilError and its subclasses, rendered in one place as
{"error": {"code": ..., "message": ...}}.

Each class is one row of the error catalogue: its status, its code, when Sigil answers it
(`meaning`), the headers it is sent with, and one message as the API words it (`example`).
The OpenAPI document's error responses and docs/errors.md are written from these classes
(sigil/error_docs.py); nothing else lists them.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from typing import ClassVar

import kombu.exceptions
import redis
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, HttpResponse
from rest_framework import exceptions as drf
from rest_framework.response import Response

from sigil.request_id import current_request_id, new_request_id

logger = logging.getLogger(__name__)

# Sent with every 401 (RFC 9110 §11.6.1): the scheme a client should answer with.
WWW_AUTHENTICATE = 'Bearer realm="sigil"'


class SigilError(Exception):
    """An expected failure, answered in the envelope with the class's status and code.

    A subclass that is a row of the catalogue sets `example` (and `meaning`); one that only
    names a cause (engine.adapter.CallerGone) inherits its parent's row.
    """

    status: ClassVar[int] = 400
    code: ClassVar[str] = "invalid_request"
    meaning: ClassVar[str]
    headers: ClassVar[dict[str, str]] = {}
    example: ClassVar[str]

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class RetryLater(SigilError):
    """An error that says when to try again: sent with Retry-After when it knows."""

    headers = {"Retry-After": "seconds to wait before trying again"}


class InvalidRequest(SigilError):
    status, code = 400, "invalid_request"
    meaning = "bad JSON, a wrong or unknown field, a name against the rules, code that fails to start, a private URL"
    example = "capability name 'Bad_Name' must match ^[a-z0-9][a-z0-9-]{0,40}$ with no '--'"


class MethodNotAllowed(InvalidRequest):
    """A method the path does not answer: `405` with the code of every malformed request."""

    status = 405
    meaning = "the method is not one this path answers"
    headers = {"Allow": "the methods the path answers"}
    example = 'Method "PUT" not allowed.'


class NotAcceptable(InvalidRequest):
    """An Accept header that rules out JSON: `406` with the code of every malformed request."""

    status = 406
    meaning = "the client accepts no JSON"
    example = "Could not satisfy the request Accept header."


class UnsupportedMediaType(InvalidRequest):
    """A body that is not JSON: `415` with the code of every malformed request."""

    status = 415
    meaning = "a body that is not application/json"
    example = 'send the body as JSON with Content-Type: application/json (this request has Content-Type "text/plain")'


# What DRF's own wording leaves out: what to send instead.
NOT_AUTHENTICATED = "send Authorization: Bearer <token>, an agent's deploy or invoke token (the owner issues them)"


class Unauthenticated(SigilError):
    status, code = 401, "unauthenticated"
    meaning = "no token, an unknown, revoked or expired one, or one of an agent the owner disabled"
    headers = {"WWW-Authenticate": WWW_AUTHENTICATE}
    example = NOT_AUTHENTICATED


class Forbidden(SigilError):
    status, code = 403, "forbidden"
    meaning = "the token's scope does not allow it, or it writes under another agent's prefix"
    example = "deploying needs a token with the deploy scope"


class NotFound(SigilError):
    status, code = 404, "not_found"
    meaning = "no such capability (or call, or path), or one the caller may not know exists"
    example = "no capability xiaoju--nothing"


class Conflict(SigilError):
    status, code = 409, "conflict"
    meaning = "a name taken by another type, a concurrent deploy, a split in the way"
    example = "xiaoju--ping is a normal capability; it cannot be redeployed as persistent"


class TooLarge(SigilError):
    status, code = 413, "too_large"
    meaning = "code or a body over its limit"
    example = "code is 10485761 bytes; the limit is 10485760 bytes"


class Cooldown(RetryLater):
    status, code = 429, "cooldown"
    meaning = "a deploy sooner than SIGIL_DEPLOY_COOLDOWN_SECONDS after the agent's last"
    example = "xiaoju deployed less than 5 s ago; retry later"


class RateLimited(RetryLater):
    status, code = 429, "rate_limited"
    meaning = "too many failing tokens from this address, or more than the agent's share (calls, ephemerals, …)"
    example = "xiaoju has 256 calls in flight, its share of this server; retry when some have ended"


class QuotaExceeded(SigilError):
    status, code = 429, "quota_exceeded"
    meaning = "more of something than Sigil allows in all (agents)"
    example = "Sigil allows at most 100 agents (SIGIL_MAX_AGENTS)"


class UpstreamError(SigilError):
    status, code = 502, "upstream_error"
    meaning = "the runtime failed (on its own side, when it does not say when to try again)"
    example = "the runtime could not place xiaoju--ping: Cloudflare answered 500"


class CapabilityError(SigilError):
    status, code = 502, "capability_error"
    meaning = "the capability threw, or ran past its memory"
    example = "xiaoju--ping threw: TypeError: undefined is not a function"


class Degraded(RetryLater):
    status, code = 503, "degraded"
    meaning = "the capability's circuit breaker is open, after repeated failures or by the owner"
    example = "xiaoju--ping is degraded after repeated failures"


class Unavailable(RetryLater):
    """Sigil cannot serve this now (Redis unreachable, a runtime process restarting); try again shortly."""

    status, code = 503, "unavailable"
    meaning = (
        "a dependency is down (Redis unreachable, a runtime restarting or failing on its own side, "
        "no room on the account)"
    )
    example = "Sigil's Redis is unreachable; try again shortly"


class Timeout(SigilError):
    status, code = 504, "timeout"
    meaning = "no answer in time (SIGIL_INVOKE_TIMEOUT_SECONDS), past its CPU limit, a placement still under way"
    example = "xiaoju--ping is still being placed after 30 s; try again shortly"


class InternalError(SigilError):
    """A bug, not an expected failure: the one code for what no handler anticipated."""

    status, code = 500, "internal_error"
    meaning = "a bug: the message names the request id its log lines carry"
    example = "Sigil failed unexpectedly; the error was logged as request 5f0c2a9e3b7d41c6"

    def __init__(self, *, request_id: str) -> None:
        super().__init__(f"Sigil failed unexpectedly; the error was logged as request {request_id}")
        self.request_id = request_id


def error_kinds() -> list[type[SigilError]]:
    """The catalogue: every class that is a row of it, by status then code."""
    return sorted((kind for kind in _error_kinds(SigilError) if "example" in vars(kind)), key=_row_order)


def _row_order(kind: type[SigilError]) -> tuple[int, str]:
    return kind.status, kind.code


def error_from_code(code: str, message: str, *, retry_after: float | None = None) -> SigilError:
    """The error a recorded `{"code", "message", "retry_after"?}` stands for (one kept across
    processes, such as a deploy's failure in a Celery task); an unknown code is an upstream error."""
    for kind in _error_kinds(SigilError):
        if kind.code == code:
            error = SigilError(message, retry_after=retry_after)  # InternalError's own constructor writes its message
            error.status, error.code, error.headers = kind.status, kind.code, kind.headers
            return error
    return UpstreamError(message, retry_after=retry_after)


def _error_kinds(base: type[SigilError]) -> list[type[SigilError]]:
    return [base, *(kind for sub in base.__subclasses__() for kind in _error_kinds(sub))]


# Redis refused, reset or timed out, directly or as Celery's broker (kombu wraps it).
REDIS_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, kombu.exceptions.OperationalError)
# What an unreachable Redis asks callers to wait: a restart or a failover takes seconds.
UNAVAILABLE_RETRY_SECONDS = 5


def error_for_unexpected(exc: BaseException | None, *, request_id: str | None = None) -> SigilError:
    """The contract's answer to an exception that no handler expected.

    Redis unreachable (refused, reset, timed out) or still loading its data after a restart
    is `503 unavailable` with Retry-After;
    anything else is `500 internal_error`, whose message carries `request_id` (unless given,
    the id of the request being served, which names its log lines, else a fresh one) for the
    caller to quote. The caller of this function logs the exception with that id.
    """
    if isinstance(exc, redis.BusyLoadingError):  # a ConnectionError too, but the owner's fix differs
        return Unavailable(
            "Sigil's Redis is reading its data back after a restart; try again shortly",
            retry_after=UNAVAILABLE_RETRY_SECONDS,
        )
    if isinstance(exc, REDIS_UNREACHABLE):
        return Unavailable("Sigil's Redis is unreachable; try again shortly", retry_after=UNAVAILABLE_RETRY_SECONDS)
    return InternalError(request_id=request_id or current_request_id() or new_request_id())


def envelope(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


def error_headers(error: SigilError) -> dict[str, str]:
    headers = {}
    if error.retry_after is not None:
        headers["Retry-After"] = retry_after_header(error.retry_after)
    if "WWW-Authenticate" in error.headers:
        headers["WWW-Authenticate"] = WWW_AUTHENTICATE
    return headers


def error_body(error: SigilError) -> bytes:
    return json.dumps(envelope(error.code, error.message)).encode()


def _first_message(detail) -> str:
    """Flatten DRF's nested error detail into one sentence naming the field."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            inner = _first_message(value)
            return inner if key in ("non_field_errors", "detail") else f"{key}: {inner}"
        return "invalid request"
    if isinstance(detail, list):
        return _first_message(detail[0]) if detail else "invalid request"
    return str(detail)


_DRF_CODES = [
    (drf.NotAuthenticated, Unauthenticated),
    (drf.AuthenticationFailed, Unauthenticated),
    (drf.PermissionDenied, Forbidden),
    (drf.NotFound, NotFound),
    (drf.MethodNotAllowed, MethodNotAllowed),
    (drf.NotAcceptable, NotAcceptable),
    (drf.UnsupportedMediaType, UnsupportedMediaType),
    (drf.ParseError, InvalidRequest),
    (drf.ValidationError, InvalidRequest),
    (drf.Throttled, RateLimited),
]


def _unsupported_media_type(request) -> str:
    sent = (getattr(request, "content_type", "") or "").split(";")[0].strip()
    got = f'Content-Type "{sent}"' if sent else "no Content-Type"
    return f"send the body as JSON with Content-Type: application/json (this request has {got})"


def _drf_message(exc: drf.APIException, context) -> str:
    if isinstance(exc, drf.NotAuthenticated):
        return NOT_AUTHENTICATED
    if isinstance(exc, drf.UnsupportedMediaType) and context.get("request") is not None:
        return _unsupported_media_type(context["request"])
    return _first_message(exc.detail)


def exception_handler(exc, context) -> Response | None:
    """DRF's EXCEPTION_HANDLER: every expected failure in the contract's envelope, and Redis
    unreachable as `503 unavailable`.

    Unknown exceptions return None so Django logs them and handler500 answers.
    """
    if isinstance(exc, Http404):
        exc = NotFound("not found")
    elif isinstance(exc, DjangoValidationError):
        exc = InvalidRequest("; ".join(exc.messages))
    elif isinstance(exc, drf.APIException):
        for drf_type, sigil_type in _DRF_CODES:
            if isinstance(exc, drf_type):
                retry = getattr(exc, "wait", None)
                converted = sigil_type(_drf_message(exc, context), retry_after=retry)
                response = Response(envelope(converted.code, converted.message), status=converted.status)
                for name, value in error_headers(converted).items():
                    response[name] = value
                return response
        return Response(envelope("invalid_request", _first_message(exc.detail)), status=exc.status_code)
    if isinstance(exc, REDIS_UNREACHABLE):
        from rest_framework.views import set_rollback  # not at the top: it imports the API settings

        logger.warning("Redis unreachable during %s: %s", context["request"].path, exc)
        set_rollback()
        exc = error_for_unexpected(exc)
    if isinstance(exc, SigilError):
        return Response(envelope(exc.code, exc.message), status=exc.status, headers=error_headers(exc))
    return None


def error_response(error: SigilError) -> HttpResponse:
    """A plain Django response in the envelope, for code outside DRF views."""
    return HttpResponse(
        error_body(error), status=error.status, content_type="application/json", headers=error_headers(error)
    )


def handler404(request, exception=None) -> HttpResponse:
    return error_response(NotFound(f"no route for {request.path}"))


def handler500(request) -> HttpResponse:
    """Django's last resort, after it has logged the traceback ("Internal Server Error: …");
    this adds the line naming the request id the caller sees."""
    exc = sys.exc_info()[1]
    error = error_for_unexpected(exc, request_id=getattr(request, "request_id", None))
    if isinstance(error, InternalError):
        logger.error("request %s failed: %s %s: %r", error.request_id, request.method, request.path, exc)
    return error_response(error)
