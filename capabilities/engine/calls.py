"""What one call holds while the engine serves it (Call), where it stands (Served), and what
its admission found (Admitted)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.tokens import Principal
    from capabilities.engine.values import CallRequest
    from capabilities.routes import CachedRoute


class Call:
    """What one call holds while it is served, and must give back however it ends."""

    __slots__ = (
        "body_size",
        "caller",
        "capability_type",
        "finished",
        "full",
        "holds_call_share",
        "inflight_process",
        "is_trial",
        "owner",
        "page_in_ms",
        "recorded",
        "request_id",
        "sent_at",
        "shown",
        "started",
        "token_hash",
        "version",
    )

    def __init__(self, full: str, capability_type: str, token_hash: str, started: float, request_id: str) -> None:
        self.full = full  # what is placed, counted and broken: a staged version's own name in a split
        self.shown = full  # the capability the caller called
        self.capability_type = capability_type
        self.token_hash = token_hash
        self.started = started
        self.request_id = request_id
        self.is_trial = False
        self.inflight_process: str | None = None  # whose in-flight count it holds, if any
        self.holds_call_share = False
        self.finished = False
        self.recorded = False  # counted as a call (finish), not as a refusal
        self.page_in_ms: float | None = None
        self.sent_at = 0.0  # epoch the request left for the runtime
        self.version: int | None = None  # the version number of the code that answered
        self.caller = ""
        self.owner = ""
        self.body_size = 0  # request-body bytes counted against the owner's share


class Served:
    """Where a call stands as it goes through the engine: what the edge needs to count and log
    it however it ends."""

    __slots__ = ("call", "capability", "started")

    def __init__(self, started: float) -> None:
        self.started = started  # perf_counter() as the call came in
        self.capability: str | None = None  # set once the path names a registered capability
        self.call: Call | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Admitted:
    """A call its admission let in, built once (Admission.admit): who calls, the capability
    they called and its route as they may see it, and what the call's read found of its
    breaker. The engine serves it from here (Engine.serve) or keeps it for later (AsyncEntry)."""

    request: CallRequest
    served: Served
    full: str  # the capability called
    principal: Principal
    token_hash: str
    route: CachedRoute
    breaker_raw: bytes | None  # None: closed
