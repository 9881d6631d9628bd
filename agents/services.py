"""Writes on agents and tokens, and the audit trail."""

from __future__ import annotations

import logging
import secrets
from datetime import datetime

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from agents import tokens
from agents.models import Agent, AuditEvent, Scope, Token
from capabilities.names import validate_agent_name
from sigil_site.errors import Conflict, InvalidRequest, QuotaExceeded
from sigil_site.redis_client import get_redis

logger = logging.getLogger(__name__)


def audit_record(*, actor: str, action: str, agent_name: str = "", subject: str = "", detail: dict | None = None) -> AuditEvent:
    """Append one event to the audit trail. Never updated or deleted afterwards."""
    return AuditEvent.objects.create(
        actor=actor, action=action, agent_name=agent_name, subject=subject, detail=detail or {}
    )


def agent_create(*, name: str, actor: str) -> Agent:
    """Register an agent. Raises InvalidRequest (name), QuotaExceeded (too many), Conflict (taken)."""
    validate_agent_name(name)
    with transaction.atomic():
        if Agent.objects.count() >= settings.SIGIL_MAX_AGENTS:
            raise QuotaExceeded(f"Sigil allows at most {settings.SIGIL_MAX_AGENTS} agents (SIGIL_MAX_AGENTS)")
        try:
            with transaction.atomic():
                agent = Agent.objects.create(name=name)
        except IntegrityError as exc:
            raise Conflict(f"agent {name!r} already exists") from exc
        audit_record(actor=actor, action="agent.created", agent_name=name, subject=name)
    return agent


def token_issue(
    *, agent: Agent, scope: str, actor: str, label: str = "", expires_at: datetime | None = None
) -> tuple[Token, str]:
    """Create a token and return it with its secret, which is never stored or shown again."""
    if scope not in Scope.values:
        raise InvalidRequest(f"scope must be one of {', '.join(Scope.values)}")
    secret = tokens.TOKEN_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        token = Token.objects.create(
            agent=agent,
            scope=scope,
            label=label,
            prefix=secret[:12],
            secret_hash=tokens.hash_secret(secret),
            expires_at=expires_at,
        )
        audit_record(
            actor=actor,
            action="token.issued",
            agent_name=agent.name,
            subject=token.prefix,
            detail={"scope": scope, "expires_at": expires_at.isoformat() if expires_at else None},
        )
    return token, secret


def token_revoke(*, token: Token, actor: str) -> bool:
    """Revoke a token; every gateway process refuses it from its next request.

    Idempotent: returns False when it was already revoked.
    """
    with transaction.atomic():
        changed = Token.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        if changed:
            audit_record(actor=actor, action="token.revoked", agent_name=token.agent.name, subject=token.prefix)
    token.refresh_from_db()
    # Written even when nothing changed: it heals a cache entry that missed the first write.
    _write_tombstones([token.secret_hash])
    return bool(changed)


def agent_set_active(*, agent: Agent, is_active: bool, actor: str) -> bool:
    """Enable or disable an agent; disabling stops all of its tokens at once. Idempotent."""
    with transaction.atomic():
        changed = Agent.objects.filter(pk=agent.pk, is_active=not is_active).update(is_active=is_active)
        if changed:
            audit_record(
                actor=actor, action="agent.enabled" if is_active else "agent.disabled", agent_name=agent.name, subject=agent.name
            )
    agent.refresh_from_db()
    # Both directions invalidate: disabling must refuse, enabling must stop refusing.
    _write_tombstones(list(agent.tokens.values_list("secret_hash", flat=True)), delete=is_active)
    return bool(changed)


def _write_tombstones(hashes: list[str], *, delete: bool = False) -> None:
    if not hashes:
        return
    pipe = get_redis().pipeline(transaction=False)
    for token_hash in hashes:
        if delete:
            pipe.delete(tokens.cache_key(token_hash))
        else:
            pipe.set(tokens.cache_key(token_hash), tokens.TOMBSTONE, ex=tokens.POSITIVE_TTL_SECONDS)
    pipe.execute()
