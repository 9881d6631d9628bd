"""Each agent's fair share of what one engine process holds for every agent: calls in flight,
placements under way, and request-body bytes in flight.

Counted in the process's memory (no Redis round trip on the warm path): a share is per web
process, so with N processes an agent may hold N times it. The defaults are far above what an
agent's ordinary use needs; the owner raises (or lowers) one agent's caps in the admin, and the
engine reads them from the token's cached entry (agents.tokens), again with no round trip.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from agents.tokens import Principal
from sigil.errors import RateLimited


@dataclass(frozen=True)
class ShareLimits:
    calls_in_flight: int
    placements_in_flight: int
    body_bytes_in_flight: int


class FairShares:
    """The counts of one process, and the rule that refuses an agent over its share with
    `429 rate_limited` (Retry-After 1): the other agents notice nothing."""

    def __init__(self, limits: ShareLimits) -> None:
        self.limits = limits
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.placements: defaultdict[str, int] = defaultdict(int)
        self.body_bytes: defaultdict[str, int] = defaultdict(int)

    @classmethod
    def from_settings(cls) -> FairShares:
        from django.conf import settings

        return cls(
            ShareLimits(
                calls_in_flight=settings.SIGIL_AGENT_CALLS_IN_FLIGHT,
                placements_in_flight=settings.SIGIL_AGENT_PLACEMENTS_IN_FLIGHT,
                body_bytes_in_flight=settings.SIGIL_AGENT_BODY_BYTES_IN_FLIGHT,
            )
        )

    def call_limit(self, principal: Principal) -> int:
        return principal.calls_in_flight or self.limits.calls_in_flight

    def placement_limit(self, principal: Principal) -> int:
        return principal.placements_in_flight or self.limits.placements_in_flight

    def take_call(self, principal: Principal) -> None:
        """Count one more call of the principal's agent in flight; RateLimited over its cap.
        The caller gives it back with give_call() however the call ends."""
        agent, limit = principal.agent_name, self.call_limit(principal)
        if self.calls[agent] >= limit:
            raise over_share(agent, limit, "calls in flight", "retry when some have ended")
        self.calls[agent] += 1

    def give_call(self, agent: str) -> None:
        left = self.calls[agent] - 1
        if left > 0:
            self.calls[agent] = left
        else:
            self.calls.pop(agent, None)

    @contextlib.contextmanager
    def placement(self, principal: Principal) -> Iterator[None]:
        """Hold one of the agent's placements under way for the block; RateLimited over its cap."""
        agent, limit = principal.agent_name, self.placement_limit(principal)
        if self.placements[agent] >= limit:
            raise over_share(agent, limit, "placements under way", "retry shortly")
        self.placements[agent] += 1
        try:
            yield
        finally:
            self.placements[agent] -= 1
            if not self.placements[agent]:
                del self.placements[agent]

    def take_body(self, owner: str, size: int) -> None:
        """Count `size` bytes of request body on their way to `owner`'s runtime process; a body
        that would take the agent past its bound is RateLimited, so that calls within the body
        limit never add up to more than the process may hold."""
        limit = self.limits.body_bytes_in_flight
        if size and self.body_bytes[owner] + size > limit and self.body_bytes[owner]:
            raise RateLimited(
                f"{owner}'s capabilities are receiving {self.body_bytes[owner]} bytes of request bodies; "
                "retry when those calls have ended",
                retry_after=1,
            )
        self.body_bytes[owner] += size

    def give_body(self, owner: str, size: int) -> None:
        if not size:
            return
        left = self.body_bytes[owner] - size
        if left > 0:
            self.body_bytes[owner] = left
        else:
            self.body_bytes.pop(owner, None)


def over_share(agent: str, limit: int, what: str, advice: str) -> RateLimited:
    """The refusal of a call past its agent's share of this server."""
    return RateLimited(f"{agent} has {limit} {what}, its share of this server; {advice}", retry_after=1)
