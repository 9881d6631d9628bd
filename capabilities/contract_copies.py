"""The Redis copy of each capability's current contract, read by MCP on every tool call.

`sigil:contract:{full}` holds the schemas of the capability's current version as a small
JSON document, or a tombstone `-`. The deploy and rollback services write it after their
transaction commits; a reader fills a missing entry from the database with SET NX, so a fill
that raced a deploy can never hide the new contract (as routes.py does for routes). Who may
call the capability is the route's to say, not this copy's.
"""

from __future__ import annotations

import json

from capabilities.contracts import Contract
from capabilities.models import Capability, CapabilityVersion, State
from sigil.redis_client import get_redis

TOMBSTONE = b"-"
TTL_SECONDS = 3600
NEGATIVE_TTL_SECONDS = 30


def key(full: str) -> str:
    return f"sigil:contract:{full}"


def encode(version: CapabilityVersion | None) -> bytes:
    contract = Contract.of(version)
    return json.dumps({"in": contract.input_schema, "out": contract.output_schema}, separators=(",", ":")).encode()


_decoded: dict[bytes, Contract] = {}


def decode(raw: bytes) -> Contract | None:
    """The contract (schemas only) in a copy; None for a tombstone. Kept per process by value,
    so a warm call parses nothing and finds its compiled validators by the same schemas."""
    if raw == TOMBSTONE:
        return None
    contract = _decoded.get(raw)
    if contract is None:
        data = json.loads(raw)
        if len(_decoded) > 10_000:
            _decoded.clear()
        contract = _decoded[raw] = Contract(input_schema=data["in"], output_schema=data["out"])
    return contract


def contract_publish(capability: Capability) -> None:
    """Make MCP see `capability`'s current contract (call after the commit)."""
    get_redis().set(key(capability.full_name), encode(capability.current_version), ex=TTL_SECONDS)


def contract_load(full: str) -> bytes:
    """Read the contract from the database and cache it unless a writer got there first."""
    capability = (
        Capability.objects.select_related("current_version")
        .defer("current_version__code")
        .exclude(state=State.REMOVED)
        .filter(full_name=full)
        .first()
    )
    if capability is None:
        value, ttl = TOMBSTONE, NEGATIVE_TTL_SECONDS
    else:
        value, ttl = encode(capability.current_version), TTL_SECONDS
    redis = get_redis()
    if not redis.set(key(full), value, ex=ttl, nx=True):
        value = redis.get(key(full)) or value
    return value
