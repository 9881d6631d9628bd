"""Bindings: turning a capability's declared `KIND:NAME` list into what a runtime gives it.

Least privilege: a capability gets exactly the bindings it declared, each of which the
owner must have configured and granted to its agent; nothing else reaches its `env`.
"""

from __future__ import annotations

import hashlib
import os
import re

from capabilities.models import Binding, BindingKind
from capabilities.runtimes.base import ResolvedBinding, secret_fingerprint
from sigil.encryption import secret_decrypt, secrets_key
from sigil.errors import Forbidden, InvalidRequest

DECLARATION = re.compile(r"(?P<kind>[A-Z0-9]+):(?P<name>[A-Z][A-Z0-9_]{0,63})")


def parse_declaration(declaration: str) -> tuple[str, str]:
    """`KV:CACHE` → ("KV", "CACHE"). Raises InvalidRequest naming the form."""
    match = DECLARATION.fullmatch(declaration) if isinstance(declaration, str) else None
    if match is None or match["kind"] not in BindingKind.values:
        raise InvalidRequest(
            f"binding {declaration!r} must look like KIND:NAME with KIND one of {', '.join(BindingKind.values)}"
            " and NAME in upper case, e.g. KV:CACHE"
        )
    return match["kind"], match["name"]


def bindings_resolve(
    declarations: list[str], *, agent_id: int, supported_kinds: frozenset[str] | None, strict: bool = True
) -> list[ResolvedBinding]:
    """Resolve the bindings an agent's capability declares against the owner's grants.

    Raises InvalidRequest for a malformed or duplicate declaration or a kind the runtime
    cannot provide (`supported_kinds`, None = all), and Forbidden for a binding not granted
    to the agent, with the same words whether it exists or not, so that refusals tell an
    agent nothing about other agents' bindings. With `strict` false (placing an already
    deployed capability) a binding no longer granted is left out instead: that is how a
    revoked grant leaves the agent's capabilities.
    """
    wanted = [parse_declaration(d) for d in declarations]
    if len({name for _, name in wanted}) != len(wanted):
        raise InvalidRequest("two bindings cannot share a name: each becomes one entry of env")
    if not wanted:
        return []
    granted = {
        (b.kind, b.name): b
        for b in Binding.objects.filter(grants__agent_id=agent_id, name__in=[name for _, name in wanted])
    }
    resolved = []
    for kind, name in wanted:
        if supported_kinds is not None and kind not in supported_kinds:
            raise InvalidRequest(
                f"binding {kind}:{name}: this runtime cannot provide {kind} bindings"
                f" (it provides {', '.join(sorted(supported_kinds))})"
            )
        binding = granted.get((kind, name))
        if binding is None:
            if strict:
                raise Forbidden(f"binding {kind}:{name} is not granted to this agent; the owner grants bindings")
            continue
        if binding.kind == BindingKind.SECRET:
            value = _secret_of(binding)
            fingerprint = secret_fingerprint(value, key=_digest_key())
            resolved.append(ResolvedBinding(kind, name, value, fingerprint=fingerprint))
        else:
            resolved.append(ResolvedBinding(kind, name, binding.value))
    return resolved


def _secret_of(binding: Binding) -> str:
    if binding.secret_env:
        value = os.environ.get(binding.secret_env)
        if value is None:
            raise InvalidRequest(f"binding SECRET:{binding.name} reads ${binding.secret_env}, which is not set")
        return value
    return secret_decrypt(binding.secret_encrypted)


def _digest_key() -> str:
    # Derived from the database's key, so a bundle's sha (which covers its secrets'
    # fingerprints) cannot be used to test guesses of a secret without that key.
    return hashlib.sha256(f"sigil-secret-fingerprint:{secrets_key()}".encode()).hexdigest()
