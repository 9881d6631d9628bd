"""The Redis copy of each capability's current contract, read by MCP on every tool call.

`redis_keys.contract(full)` holds the schemas of the capability's current version as a small
JSON document, or a tombstone `-`. The one publisher of the copies, `copies.copies_publish`,
writes it after each write of the capability's row commits; a reader fills a missing entry
from the database with SET NX, so a fill that raced a deploy can never hide the new contract
(as routes.py does for routes). Who may call the capability is the route's to say, not this
copy's.
"""

from __future__ import annotations

import json

from capabilities.books import routes
from capabilities.contracts import Contract
from capabilities.models import CapabilityVersion
from sigil import redis_keys

TOMBSTONE = b"-"
TTL_SECONDS = 3600
NEGATIVE_TTL_SECONDS = 30


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


def contract_load(full: str) -> bytes:
    """Read the contract from the database and cache it unless a writer got there first."""
    capability = routes.route_row(full)
    if capability is None:
        return routes.fill(redis_keys.contract(full), TOMBSTONE, ttl=NEGATIVE_TTL_SECONDS)
    return routes.fill(redis_keys.contract(full), encode(capability.current_version), ttl=TTL_SECONDS)
