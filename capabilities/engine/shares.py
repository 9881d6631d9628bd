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
        _take(self.calls, agent, limit, held="calls in flight", retry="retry when some have ended")

    def give_call(self, agent: str) -> None:
        _give(self.calls, agent, 1)

    @contextlib.contextmanager
    def placement(self, principal: Principal) -> Iterator[None]:
        """Hold one of the agent's placements under way for the block; RateLimited over its cap."""
        agent, limit = principal.agent_name, self.placement_limit(principal)
        _take(self.placements, agent, limit, held="placements under way", retry="retry shortly")
        try:
            yield
        finally:
            _give(self.placements, agent, 1)

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
        if size:
            _give(self.body_bytes, owner, size)


def _take(counts: defaultdict[str, int], agent: str, limit: int, *, held: str, retry: str) -> None:
    """Count one more of `agent`'s in `counts`, or refuse it (429, Retry-After 1) at its share."""
    if counts[agent] >= limit:
        raise RateLimited(f"{agent} has {limit} {held}, its share of this server; {retry}", retry_after=1)
    counts[agent] += 1


def _give(counts: defaultdict[str, int], agent: str, amount: int) -> None:
    """Give back `amount` of `agent`'s in `counts`, forgetting an agent that holds none."""
    left = counts[agent] - amount
    if left > 0:
        counts[agent] = left
    else:
        counts.pop(agent, None)
