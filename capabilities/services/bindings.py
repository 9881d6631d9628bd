"""The owner's bindings: saving and deleting them, granting them to agents and taking them
back, and bringing each change to the live capabilities it concerns."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from agents.models import Agent
from agents.services import audit_record
from capabilities import selectors
from capabilities.jobs import capability_refresh_bindings as capability_refresh_bindings_task
from capabilities.models import Binding, BindingGrant, State
from sigil.encryption import secret_encrypt
from sigil.errors import Conflict


def binding_check_rename(binding: Binding, *, kind: str, name: str) -> None:
    """A binding that capabilities declare keeps its kind and name (they would lose it at
    their next placement). Raises Conflict naming them."""
    if binding.pk is None or (binding.kind, binding.name) == (kind, name):
        return
    _refuse_if_declared(binding, "renamed")


def binding_save(*, binding: Binding, secret_value: str = "", actor: str) -> list[str]:
    """Store `binding` (a new secret value is encrypted and replaces an environment variable),
    audit it, and queue placing again every live capability that declares it and whose agent
    holds a grant, so that the new value reaches them. Returns the full names queued. Raises
    Conflict (see `binding_check_rename`)."""
    created = binding.pk is None
    if not created:
        stored = Binding.objects.get(pk=binding.pk)
        binding_check_rename(stored, kind=binding.kind, name=binding.name)
    if secret_value:
        binding.secret_encrypted = secret_encrypt(secret_value)
        binding.secret_env = ""
    binding.updated_at = timezone.now()
    declared = [] if created else selectors.binding_declared_by(binding.kind, binding.name)
    granted = set(binding.grants.values_list("agent_id", flat=True)) if declared else set()
    refreshing = [c.full_name for c in declared if c.state == State.LIVE and c.agent_id in granted]
    with transaction.atomic():
        binding.save()
        audit_record(
            actor=actor,
            action="binding.created" if created else "binding.changed",
            subject=str(binding),
            detail={"refreshing": refreshing} if refreshing else None,
        )
        for full in refreshing:
            capability_refresh_bindings_task.delay_on_commit(full=full)
    return refreshing


def binding_delete(*, binding: Binding, actor: str) -> None:
    """Delete a binding no capability declares. Raises Conflict naming those that do."""
    _refuse_if_declared(binding, "deleted")
    with transaction.atomic():
        audit_record(actor=actor, action="binding.deleted", subject=str(binding))
        binding.delete()


def _refuse_if_declared(binding: Binding, what: str) -> None:
    users = selectors.binding_declared_by(binding.kind, binding.name)
    if users:
        shown = ", ".join(c.full_name for c in users[:5]) + (" ..." if len(users) > 5 else "")
        raise Conflict(f"{binding} is declared by {shown}; it cannot be {what} while they use it")


def binding_grant(*, binding: Binding, agent: Agent, actor: str) -> list[str]:
    """Let `agent` declare `binding`, audit it, and queue placing again the agent's live
    capabilities that already declare it (placed without it while it was not granted).
    Returns the full names queued. Idempotent: granting again changes nothing."""
    with transaction.atomic():
        _, created = BindingGrant.objects.get_or_create(binding=binding, agent=agent)
        if not created:
            return []
        return _record_and_refresh(binding, agent, actor=actor, action="binding.granted")


def binding_revoke(*, binding: Binding, agent: Agent, actor: str) -> list[str]:
    """Take `binding` back from `agent`: its capabilities may no longer declare it, and its
    live ones that do are placed again without it, as a changed value reaches them. Audited.
    Returns the full names queued. Idempotent: revoking what is not granted changes nothing."""
    with transaction.atomic():
        deleted, _ = BindingGrant.objects.filter(binding=binding, agent=agent).delete()
        if not deleted:
            return []
        return _record_and_refresh(binding, agent, actor=actor, action="binding.revoked")


def _record_and_refresh(binding: Binding, agent: Agent, *, actor: str, action: str) -> list[str]:
    declared = selectors.binding_declared_by(binding.kind, binding.name, agent_id=agent.pk)
    refreshing = [c.full_name for c in declared if c.state == State.LIVE]
    audit_record(
        actor=actor,
        action=action,
        agent_name=agent.name,
        subject=str(binding),
        detail={"refreshing": refreshing} if refreshing else None,
    )
    for full in refreshing:
        capability_refresh_bindings_task.delay_on_commit(full=full)
    return refreshing
