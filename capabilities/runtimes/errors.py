"""The errors every runtime raises, whatever it runs on: transient (retry) or for good."""

from __future__ import annotations

import re
from urllib.parse import urlsplit


class RuntimeFailure(Exception):
    """Base of every error a runtime raises."""


class RuntimeUnavailable(RuntimeFailure):
    """The runtime could not be reached or failed transiently; retrying may succeed."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RuntimeThrottled(RuntimeUnavailable):
    """The runtime's provider refuses every call for a while (Cloudflare's rate-limit lockout,
    or Sigil's shared budget for it having no room); `retry_after` says for how long, in
    seconds, as the provider answered. `why`, when set, is that in one sentence of Sigil's
    own, fit for the caller (the message may hold the provider's words, kept for the log)."""

    why: str | None = None


class RuntimeRejected(RuntimeFailure):
    """The runtime refused the code or the request for good; retrying will not help."""


class ScriptTooLarge(RuntimeRejected):
    """The code is over the runtime's script size limit."""


class SlotsExhausted(RuntimeRejected):
    """The runtime has no room for another script (its quota is reached)."""


def network_failure(exc: BaseException) -> str:
    """What failed on the wire, in words, e.g. `127.0.0.1:8787: Connection refused`.

    requests' and urllib3's own text nests their errors, with reprs such as
    `<urllib3.connection.HTTPConnection object at 0x…>` that tell the owner nothing; the
    innermost OS error (refused, unreachable, unknown name, timed out) does.
    """
    where = ""
    request = getattr(exc, "request", None)  # requests' errors know their URL
    url = getattr(request, "url", None) or getattr(exc, "url", None)
    pool = getattr(exc, "pool", None)  # urllib3's know their pool
    if url and "://" in url:
        where = f"{urlsplit(url).netloc}: "
    elif pool is not None and getattr(pool, "host", None):
        where = f"{pool.host}:{pool.port}: "
    cause: BaseException | None = exc
    innermost_os_error = None
    seen = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.strerror:
            innermost_os_error = cause
        reason = getattr(cause, "reason", None)  # urllib3's MaxRetryError names the real one
        if isinstance(reason, BaseException):
            cause = reason
        elif cause.args and isinstance(cause.args[0], BaseException):
            cause = cause.args[0]
        else:
            cause = cause.__cause__ or cause.__context__
    if innermost_os_error is not None:
        return where + innermost_os_error.strerror
    return where + re.sub(r"<[\w.]+ object at 0x[0-9a-fA-F]+>:?\s*", "", str(exc))
