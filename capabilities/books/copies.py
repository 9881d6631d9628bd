"""The one publisher of a capability's Redis copies: its route (routes.py), read by the
gateway on every call, and its contract (contract_copies.py), read by MCP on every tool call.

Nobody writes a copy by hand: every write of a capability's row is made inside
`services.records.capability_written`, which calls `copies_publish` once it commits, and the
copies are rebuilt from the row as it is then. The route's copy at the edge (Workers KV) is
marked to be published again here too. Cost: one query and one Redis round trip per write of
a row (one more with the edge on); the warm call only reads the copies.
"""

from __future__ import annotations

import copy

from capabilities.books import contract_copies, routes
from capabilities.models import Capability, State
from sigil import redis_keys
from sigil.edge_state import edge_mark, route_key
from sigil.redis_client import get_redis

# KEYS: the route. ARGV: the route of an evicting row, the same turned away, the TTL.
# A page-out turns its victim's route away (paged out) before its row says so
# (`route_turn_away`): a write of the row meanwhile keeps it turned away.
PUBLISH_EVICTING = """
local current = redis.call('GET', KEYS[1])
local turned_away = current and string.find(current, '"state":"paged_out"', 1, true)
redis.call('SET', KEYS[1], turned_away and ARGV[2] or ARGV[1], 'EX', ARGV[3])
"""


def copies_publish(full: str) -> Capability | None:
    """Make the gateway and MCP see `full` as the database has it now (call after the
    commit): its route and contract, or their tombstones when it is removed; and mark its
    route for the edge (sigil.edge_state). Returns the row published, or None. Idempotent."""
    capability = routes.route_row(full)
    pipe = get_redis().pipeline(transaction=False)
    if capability is None:
        pipe.set(redis_keys.route(full), routes.TOMBSTONE, ex=routes.NEGATIVE_TTL_SECONDS)
        pipe.set(redis_keys.contract(full), contract_copies.TOMBSTONE, ex=contract_copies.NEGATIVE_TTL_SECONDS)
    else:
        if capability.state == State.EVICTING:
            route, away = routes.encode(capability), _turned_away(capability)
            pipe.eval(PUBLISH_EVICTING, 1, redis_keys.route(full), route, away, routes.TTL_SECONDS)
        else:
            pipe.set(redis_keys.route(full), routes.encode(capability), ex=routes.TTL_SECONDS)
        pipe.set(
            redis_keys.contract(full),
            contract_copies.encode(capability.current_version),
            ex=contract_copies.TTL_SECONDS,
        )
    pipe.execute()
    edge_mark(route_key(full))
    return capability


def route_turn_away(capability: Capability) -> None:
    """Publish `capability`'s route as paged out before its row says so: new calls go to page
    it in (and wait for its placement lock) while its page-out waits for the calls in flight.
    The row's own write republishes the route from the database after."""
    get_redis().set(redis_keys.route(capability.full_name), _turned_away(capability), ex=routes.TTL_SECONDS)


def _turned_away(capability: Capability) -> bytes:
    leaving = copy.copy(capability)
    leaving.state = State.PAGED_OUT
    return routes.encode(leaving)
