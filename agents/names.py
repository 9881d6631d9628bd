"""The agent-name rule: what an agent may be called. Pure functions, no I/O."""

from __future__ import annotations

import re

from sigil.errors import InvalidRequest

AGENT_RULE = "^[a-z][a-z0-9-]{0,30}$ with no '--'"
AGENT_PATTERN = r"[a-z][a-z0-9-]{0,30}"
_AGENT = re.compile(AGENT_PATTERN)
# What follows an agent's name in every name built on it (a capability's full name,
# `agent--name`): so no agent name holds it.
SEPARATOR = "--"
# Paths Sigil itself serves at the top level; an agent with one of these names could never
# be reached through the engine.
RESERVED_AGENT_NAMES = frozenset({"admin", "static", "metrics"})


def validate_agent_name(name: object) -> str:
    """Return `name` if it is a valid agent name. Raises InvalidRequest naming the rule."""
    if not isinstance(name, str) or not _AGENT.fullmatch(name) or SEPARATOR in name:
        raise InvalidRequest(f"agent name {name!r} must match {AGENT_RULE}")
    if name in RESERVED_AGENT_NAMES:
        raise InvalidRequest(f"agent name {name!r} is reserved by Sigil")
    return name
