"""What one call holds while the engine serves it (Call), and where it stands (Served)."""

from __future__ import annotations


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
