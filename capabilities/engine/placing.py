"""A cold call's page-in: one placement per capability at a time, awaited without a thread.

In this process, the calls that find a placement under way await it; across processes, the
placement lock decides, and a call that finds it held watches the route in Redis until it is
served or the lock is let go. A placement runs in the pool (Offload), within its caller's
share of placements (engine.shares)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from django.conf import settings

from agents.tokens import Principal
from capabilities.books import routes
from capabilities.engine.offload import Offload
from capabilities.engine.shares import FairShares
from capabilities.runtimes.api_work import ApiClass, api_work
from capabilities.services.placement import PlacementUnderWay, capability_page_in
from sigil import redis_keys
from sigil.errors import NotFound, Timeout

# How a call watches another call's (or process's) placement of its capability.
PLACEMENT_POLL_FIRST_SECONDS = 0.01
PLACEMENT_POLL_MAX_SECONDS = 0.2


@dataclass(slots=True, eq=False)
class Placer:
    """The page-ins of one engine, and the placements under way in its process."""

    redis: aioredis.Redis
    offload: Offload
    shares: FairShares
    lock_seconds: float = field(init=False)
    placing: dict[str, asyncio.Future] = field(default_factory=dict)  # this process's placements under way

    def __post_init__(self) -> None:
        self.lock_seconds = settings.SIGIL_PLACEMENT_LOCK_SECONDS

    async def page_in(
        self, full: str, principal: Principal, *, wait_seconds: float | None
    ) -> tuple[routes.CachedRoute, float]:
        """Place `full`, or wait for the placement under way (at most `wait_seconds`, then
        Timeout; None: the placement lock's own timeout); the route and the ms it took.
        NotFound when the capability was removed meanwhile."""
        started = time.perf_counter()
        waited = wait_seconds or self.lock_seconds
        deadline = started + waited
        pause = PLACEMENT_POLL_FIRST_SECONDS
        while True:
            try:
                placing = self.placing.get(full)
                locked = placing is None and await self.redis.exists(redis_keys.place_lock(full))
                # Calls that arrive together all ask Redis before any starts the placement: the
                # first answered starts it, the others await it (and take no placement share).
                placing = self.placing.get(full)
                if placing is None and not locked:
                    with self.shares.placement(principal):
                        placing = self.placing[full] = asyncio.ensure_future(self.place(full, deadline))
                        try:
                            route = await asyncio.wait_for(asyncio.shield(placing), deadline - time.perf_counter())
                        finally:
                            if self.placing.get(full) is placing:
                                del self.placing[full]
                    return route, (time.perf_counter() - started) * 1000
                if placing is not None:
                    route = await asyncio.wait_for(asyncio.shield(placing), deadline - time.perf_counter())
                    return route, (time.perf_counter() - started) * 1000
            except PlacementUnderWay:
                pass  # another process holds the lock: watch for what its placement makes
            except TimeoutError:
                raise Timeout(f"{full} is still being placed after {waited:g} s; try again shortly") from None
            while True:
                if time.perf_counter() + pause > deadline:
                    raise Timeout(f"{full} is still being placed after {waited:g} s; try again shortly")
                await asyncio.sleep(pause)
                pause = min(pause * 2, PLACEMENT_POLL_MAX_SECONDS)
                raw, locked = await self.redis.mget((redis_keys.route(full), redis_keys.place_lock(full)))
                route = routes.decode(raw) if raw is not None else None
                if route is not None and route.state in routes.SERVED_STATES:
                    return route, (time.perf_counter() - started) * 1000
                if raw == routes.TOMBSTONE:
                    raise NotFound(f"no capability {full}")
                if locked is None:
                    break  # the placement ended without serving it: try it here

    async def place(self, full: str, deadline: float) -> routes.CachedRoute:
        """Page `full` in for a caller who waits until `deadline` (perf_counter): its API calls
        are a page-in's, first in the budget's order, and wait for room no longer than the
        caller would (a spent budget answers at once, with the time until room)."""
        with api_work(ApiClass.PAGE_IN, wait_seconds=max(0.0, deadline - time.perf_counter())):
            route, _ = await self.offload(capability_page_in, full=full, wait_seconds=0)
        return route
