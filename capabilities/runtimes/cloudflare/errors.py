"""Cloudflare's answers that are not a success: its error codes the client reads, and the
error types it raises, each one of the runtime error types as well (so runtimes raise only
those)."""

from __future__ import annotations

from capabilities.runtimes.errors import (
    RuntimeFailure,
    RuntimeRejected,
    RuntimeThrottled,
    RuntimeUnavailable,
    ScriptTooLarge,
    SlotsExhausted,
)

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


class CloudflareError(RuntimeFailure):
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


class CloudflareUnavailable(CloudflareError, RuntimeUnavailable):
    """Transient: a connection error, a timeout, a 5xx or a concurrent change. Retry later."""


class CloudflareRateLimited(CloudflareUnavailable, RuntimeThrottled):
    """The rate budget (Sigil's shared one, or Cloudflare's, code 971) has no room.

    `retry_after` says in how many seconds to try again.
    """


class CloudflareRejected(CloudflareError, RuntimeRejected):
    """Cloudflare refused the request for good (validation, bad name, no route, ...)."""


class CloudflareNotFound(CloudflareRejected):
    """The script, subdomain, namespace or KV key does not exist (any 404 but a bad route,
    and 10007, 10009, 10013 whatever the status)."""


class CloudflarePlanRequired(CloudflareRejected):
    """The account's plan lacks what the call needs: the Workers Paid plan for a Worker
    Loader binding, or the Workers for Platforms subscription for dispatch namespaces."""


class CloudflareAuthFailure(CloudflareRejected):
    """The API token is invalid, expired or lacks a permission (10000, 10023)."""


class CloudflareScriptTooLarge(CloudflareRejected, ScriptTooLarge):
    """The script is over the account's size limit (10027)."""


class CloudflareSlotsExhausted(CloudflareRejected, SlotsExhausted):
    """The account holds as many Workers as its plan allows (10037)."""
