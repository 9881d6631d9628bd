"""Cloudflare's answers that are not a success: its error codes the client reads, and the
error types it raises, each one of the runtime error types as well (so runtimes raise only
those)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from capabilities.runtimes import errors as runtime_errors

# Cloudflare's error codes (reference §7.1) that the client treats specially.
CODE_RATE_LIMITED = 971
CODE_NO_ROUTE = 7000
CODE_BAD_ROUTE = 7003
CODE_AUTHENTICATION = 10000
CODE_INTERNAL = 10002
CODE_NOT_FOUND = 10007
CODE_KV_KEY_NOT_FOUND = 10009
CODE_KV_NAMESPACE_NOT_FOUND = 10013
CODE_UNAUTHORIZED = 10023
CODE_SCRIPT_TOO_LARGE = 10027
CODE_CONCURRENT_CHANGE = 10035
CODE_TOO_MANY_SCRIPTS = 10037
CODE_NOT_ENTITLED = 10015
CODE_VALIDATION = 10021
CODE_KV_BINDING_INVALID = 10042
CODE_PAID_PLAN_REQUIRED = 10075
CODE_LOADER_PAID_PLAN = 10195

_NOT_FOUND_CODES = frozenset({CODE_NOT_FOUND, CODE_KV_KEY_NOT_FOUND, CODE_KV_NAMESPACE_NOT_FOUND})
_AUTH_CODES = frozenset({CODE_AUTHENTICATION, CODE_UNAUTHORIZED})
# A 404 means "not found" whatever its code (the code of a missing dispatch namespace is in no
# public source), except these: no route for the URL, i.e. a wrong account id or API base.
_ROUTE_CODES = frozenset({CODE_NO_ROUTE, CODE_BAD_ROUTE})
# The account's plan lacks a feature: Workers Paid (10075), Dynamic Workers (10195, observed),
# or an entitlement such as Workers for Platforms (10015; its real code is in no source).
_PLAN_CODES = frozenset({CODE_NOT_ENTITLED, CODE_PAID_PLAN_REQUIRED, CODE_LOADER_PAID_PLAN})
# 10035: "multiple attempts to modify a resource at the same time"; waiting resolves it.
_TRANSIENT_CODES = frozenset({CODE_INTERNAL, CODE_CONCURRENT_CHANGE})
# Statuses worth another attempt, as Cloudflare's own SDK decides (reference §0), less 409:
# Cloudflare also uses 409 for real conflicts, and 10035 covers the transient one by code.
_RETRY_STATUSES = frozenset({408, 429})


# --- errors -----------------------------------------------------------------------------


class CloudflareError(runtime_errors.RuntimeFailure):
    """An answer (or the lack of one) from the Cloudflare API that is not a success.

    `status` is the HTTP status (None when no answer came), `code` the first Cloudflare
    error code of the envelope (None when there was none).
    """

    def __init__(
        self, message: str, *, status: int | None = None, code: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


class CloudflareUnavailable(CloudflareError, runtime_errors.RuntimeUnavailable):
    """Transient: a connection error, a timeout, a 5xx or a concurrent change. Retry later."""


class CloudflareRateLimited(CloudflareUnavailable, runtime_errors.RuntimeThrottled):
    """The rate budget (Sigil's shared one, or Cloudflare's, code 971) has no room.

    `retry_after` says in how many seconds to try again; `why` says so in Sigil's words when
    Sigil's own budget refused (Cloudflare's 429 has none: its words stay in the log).
    """

    def __init__(self, message: str, *, why: str | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.why = why


class CloudflareRejected(CloudflareError, runtime_errors.RuntimeRejected):
    """Cloudflare refused the request for good (validation, bad name, no route, ...)."""


class CloudflareNotFound(CloudflareRejected):
    """The script, subdomain, namespace or KV key does not exist (any 404 but a bad route,
    and 10007, 10009, 10013 whatever the status)."""


class CloudflarePlanRequired(CloudflareRejected):
    """The account's plan lacks what the call needs: the Workers Paid plan for a Worker
    Loader binding, or the Workers for Platforms subscription for dispatch namespaces."""


class CloudflareAuthFailure(CloudflareRejected):
    """The API token is invalid, expired or lacks a permission (10000, 10023)."""


class CloudflareScriptTooLarge(CloudflareRejected, runtime_errors.ScriptTooLarge):
    """The script is over the account's size limit (10027)."""


class CloudflareSlotsExhausted(CloudflareRejected, runtime_errors.SlotsExhausted):
    """The account holds as many Workers as its plan allows (10037)."""


# --- Cloudflare's answer, read ----------------------------------------------------------------


def error_for(
    status: int, envelope: Any, *, where: str, path: str, retry_after: float | None, redact: Callable[[str], str]
) -> CloudflareError:
    """The error a failed answer stands for: its status and the first error of its envelope
    (`envelope` is None when the body was not JSON), said after `where` (the call, or "") and
    passed through `redact` so that no echoed secret is kept."""
    errors = envelope.get("errors") if isinstance(envelope, dict) else None
    first = errors[0] if isinstance(errors, list) and errors and isinstance(errors[0], dict) else {}
    code = first.get("code") if isinstance(first.get("code"), int) else None
    detail = str(first.get("message") or "no error message")
    message = redact(f"{where}Cloudflare answered {status}" + (f", code {code}: {detail}" if code else f": {detail}"))
    kwargs = {"status": status, "code": code, "retry_after": retry_after}
    if code in _AUTH_CODES or status == 401:
        return CloudflareAuthFailure(message, **kwargs)
    if code == CODE_RATE_LIMITED or status == 429:
        return CloudflareRateLimited(message, **kwargs)
    if code == CODE_SCRIPT_TOO_LARGE:
        return CloudflareScriptTooLarge(message, **kwargs)
    if code == CODE_TOO_MANY_SCRIPTS:
        return CloudflareSlotsExhausted(message, **kwargs)
    if code in _PLAN_CODES or (code == CODE_VALIDATION and "of type worker_loader is invalid" in detail):
        return CloudflarePlanRequired(redact(where + _plan_message(path, detail, code)), **kwargs)
    if code == CODE_KV_BINDING_INVALID:
        return CloudflareRejected(
            redact(f"{where}a KV binding names a KV namespace the account lacks (code {code}: {detail})"), **kwargs
        )
    # A 404 without Cloudflare's envelope comes from something else (a proxy, a wrong API base).
    if code in _NOT_FOUND_CODES or (status == 404 and code not in _ROUTE_CODES and isinstance(envelope, dict)):
        return CloudflareNotFound(message, **kwargs)
    if code in _TRANSIENT_CODES or status >= 500 or status in _RETRY_STATUSES:
        return CloudflareUnavailable(message, **kwargs)
    return CloudflareRejected(message, **kwargs)


def _plan_message(path: str, detail: str, code: int | None) -> str:
    """Plain words for a plan refusal, with Cloudflare's own answer after them."""
    if "/workers/dispatch/" in path:
        need = "dispatch namespaces need a Workers for Platforms subscription on the account"
    elif "worker_loader" in detail or code == CODE_LOADER_PAID_PLAN:
        need = "a Worker Loader binding (the loader runtime) needs the Workers Paid plan"
    else:
        need = "the account's plan does not include this feature"
    return f"{need} (Cloudflare answered code {code}: {detail})"
