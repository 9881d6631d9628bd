"""Naming rules for capabilities, built on the agent-name rule (agents/names.py); what the
runtimes call their scripts is theirs. Pure functions, no I/O."""

from __future__ import annotations

import re
import secrets

from agents.names import AGENT_PATTERN, SEPARATOR, validate_agent_name
from sigil.errors import InvalidRequest

CAPABILITY_RULE = "^[a-z0-9][a-z0-9-]{0,40}$ with no '--'"

CAPABILITY_PATTERN = r"[a-z0-9][a-z0-9-]{0,40}"
_CAPABILITY = re.compile(CAPABILITY_PATTERN)
# A full name as the API's paths take it (`agent--name`), for the OpenAPI description; the
# rules above also refuse a '--' inside either part, which a pattern alone cannot say simply.
FULL_NAME_PATTERN = f"^{AGENT_PATTERN}{SEPARATOR}{CAPABILITY_PATTERN}$"
EPHEMERAL_PREFIX = "t-"


def validate_capability_name(name: object, *, ephemeral: bool = False) -> str:
    """Return `name` if it is a valid short capability name for its type.

    The `t-` prefix belongs to ephemerals, whose names Sigil makes. Raises InvalidRequest.
    """
    if not isinstance(name, str) or not _CAPABILITY.fullmatch(name) or SEPARATOR in name:
        raise InvalidRequest(f"capability name {name!r} must match {CAPABILITY_RULE}")
    if name.startswith(EPHEMERAL_PREFIX) and not ephemeral:
        raise InvalidRequest(f"capability name {name!r}: the 't-' prefix is reserved for ephemeral capabilities")
    return name


def full_name(agent: str, name: str) -> str:
    return f"{agent}{SEPARATOR}{name}"


def placement_label(full: str) -> str:
    """How the owner reads a placement's name: a split's staged version, placed as
    `{full}--v{n}` (routes.variant_name), is `{full} (staged v{n})`; any other is itself."""
    parent, sep, version = full.rpartition(SEPARATOR)
    if sep and SEPARATOR in parent and version.startswith("v") and version[1:].isdigit():
        return f"{parent} (staged {version})"
    return full


def agent_of(full: str) -> str:
    """The agent whose capability, or staged version of one (`{full}--v{n}`), `full` names:
    the tenant a runtime is given with its slot."""
    return full.partition(SEPARATOR)[0]


def split_full_name(full: str) -> tuple[str, str]:
    """`xiaoju--ping` → ("xiaoju", "ping"). Raises InvalidRequest for anything else."""
    agent, sep, name = full.partition(SEPARATOR)
    if not sep:
        raise InvalidRequest(f"{full!r} is not a full capability name (agent--name)")
    validate_agent_name(agent)
    validate_capability_name(name, ephemeral=True)
    return agent, name


def new_ephemeral_name() -> str:
    """A fresh `t-{hash6}` name; the caller retries on the rare collision."""
    return EPHEMERAL_PREFIX + secrets.token_hex(3)


_VARIANT_SUFFIX = re.compile(r"v[0-9]+")


def is_variant(full: str) -> bool:
    """Whether `full` names the placement of a staged version in traffic (`{full}--v{n}`,
    routes.variant_name), which no capability's full name can be (names hold no `--`)."""
    parts = full.split(SEPARATOR)
    return len(parts) == 3 and bool(_VARIANT_SUFFIX.fullmatch(parts[2]))
