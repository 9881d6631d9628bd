"""Who may see a capability: its own agent, and every agent when it is public.

Seeing is listing, inspecting and calling it; what it said and how its calls went (its code,
figures, logs, deploys) are its own agent's alone. `may_see` states the rule once, for a row
or a route in hand (booleans) and for a query (Q objects) alike: `|` is "or" for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from django.db.models import Q

if TYPE_CHECKING:
    from agents.tokens import Principal
    from capabilities.models import Capability

Condition = TypeVar("Condition", bool, Q)


def may_see(own: Condition, public: Condition) -> Condition:
    """The rule: an agent may see its own capabilities and every public one."""
    return own | public


def capability_own(capability: Capability, principal: Principal) -> bool:
    """Whether `capability` is the caller's own (what only its owner reads)."""
    return capability.agent_id == principal.agent_id


def capability_visible(capability: Capability, principal: Principal) -> bool:
    """Whether the caller may see `capability`."""
    return may_see(capability_own(capability, principal), capability.is_public)


def visible_q(principal: Principal) -> Q:
    """The capabilities the caller may see, as a filter on Capability."""
    return may_see(Q(agent_id=principal.agent_id), Q(is_public=True))
