"""The errors every runtime raises, whatever it runs on: transient (retry) or for good."""

from __future__ import annotations


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
    seconds, as the provider answered."""


class RuntimeRejected(RuntimeFailure):
    """The runtime refused the code or the request for good; retrying will not help."""


class ScriptTooLarge(RuntimeRejected):
    """The code is over the runtime's script size limit."""


class SlotsExhausted(RuntimeRejected):
    """The runtime has no room for another script (its quota is reached)."""
