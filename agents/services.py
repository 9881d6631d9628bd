"""Writes on agents and tokens, and the audit trail."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

import requests
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import IntegrityError, transaction
from django.utils import timezone

from agents import a2a, egress, jobs, tokens
from agents.models import Agent, AuditEvent, Scope, Token
from agents.names import validate_agent_name
from sigil import redis_keys
from sigil.edge_state import edge_mark, token_key
from sigil.errors import Conflict, InvalidRequest, QuotaExceeded
from sigil.redis_client import get_redis

logger = logging.getLogger(__name__)


def audit_record(
    *, actor: str, action: str, agent_name: str = "", subject: str = "", detail: dict | None = None
) -> AuditEvent:
    """Append one event to the audit trail. Never updated or deleted afterwards."""
    return AuditEvent.objects.create(
        actor=actor, action=action, agent_name=agent_name, subject=subject, detail=detail or {}
    )


def _agent_event(agent_name: str, *, actor: str, action: str, detail: dict | None = None) -> None:
    """Audit an event whose subject is the agent itself."""
    audit_record(actor=actor, action=action, agent_name=agent_name, subject=agent_name, detail=detail)


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
        _agent_event(name, actor=actor, action="agent.created")
    return agent


@dataclass(frozen=True)
class AgentCreated:
    """A new agent with its two tokens, each with its secret, which is never stored or shown again."""

    agent: Agent
    deploy: tuple[Token, str]
    invoke: tuple[Token, str]


@transaction.atomic
def agent_create_with_tokens(*, name: str, actor: str, label: str) -> AgentCreated:
    """Register an agent with a deploy token and an invoke token (both labelled `label`): what
    an agent needs to deploy and call. Raises what `agent_create` raises; nothing is created then."""
    agent = agent_create(name=name, actor=actor)
    deploy = token_issue(agent=agent, scope=Scope.DEPLOY, actor=actor, label=label)
    invoke = token_issue(agent=agent, scope=Scope.INVOKE, actor=actor, label=label)
    return AgentCreated(agent=agent, deploy=deploy, invoke=invoke)


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
    # No Redis copy to write (the first use fills it), but the edge's is: until then the edge
    # sends its calls to the origin.
    edge_mark(token_key(token.secret_hash))
    return token, secret


def token_revoke(*, token: Token, actor: str) -> bool:
    """Revoke a token; every web process refuses it from its next request.

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
            _agent_event(agent.name, actor=actor, action="agent.enabled" if is_active else "agent.disabled")
    agent.refresh_from_db()
    # Both directions invalidate: disabling must refuse, enabling must stop refusing. A live
    # token of a disabled agent is refused saying so; a revoked one stays plainly revoked.
    if is_active:
        _write_tombstones(list(agent.tokens.values_list("secret_hash", flat=True)), delete=True)
    else:
        live = agent.tokens.filter(revoked_at__isnull=True).values_list("secret_hash", flat=True)
        _write_tombstones(list(live), value=tokens.DISABLED)
        _write_tombstones(list(agent.tokens.filter(revoked_at__isnull=False).values_list("secret_hash", flat=True)))
    return bool(changed)


def agent_set_shares(
    *, agent: Agent, calls_in_flight: int | None, placements_in_flight: int | None, actor: str
) -> bool:
    """Set the agent's own caps on its calls and placements in flight per web process (None:
    the defaults). Every process applies them from the agent's next call. Returns False when
    nothing changed. Raises InvalidRequest for a cap below 1. Idempotent."""
    for value in (calls_in_flight, placements_in_flight):
        if value is not None and value < 1:
            raise InvalidRequest("a cap on calls or placements in flight is at least 1 (empty: the default)")
    with transaction.atomic():
        changed = (
            Agent.objects.filter(pk=agent.pk)
            .exclude(max_calls_in_flight=calls_in_flight, max_placements_in_flight=placements_in_flight)
            .update(max_calls_in_flight=calls_in_flight, max_placements_in_flight=placements_in_flight)
        )
        if changed:
            shares = {"calls_in_flight": calls_in_flight, "placements_in_flight": placements_in_flight}
            _agent_event(agent.name, actor=actor, action="agent.shares_changed", detail=shares)
    agent.refresh_from_db()
    # The caps ride in the tokens' cached entries: dropped, they are read again with the new ones.
    _write_tombstones(list(agent.tokens.values_list("secret_hash", flat=True)), delete=True)
    return bool(changed)


def agent_set_webhook(*, agent: Agent, url: str, secret: str | None, actor: str) -> bool:
    """Set where the agent's alerts are posted and, when `secret` is not None, the HMAC key
    that signs them ("" removes it). Returns False when nothing changed. Raises
    InvalidRequest for a URL that is not http(s). The secret never enters the audit trail."""
    if url:
        try:
            URLValidator(schemes=["http", "https"])(url)
        except ValidationError as exc:
            raise InvalidRequest(f"webhook URL {url!r} is not an http(s) URL") from exc
    with transaction.atomic():
        current = Agent.objects.select_for_update().get(pk=agent.pk)
        secret_changed = secret is not None and secret != _stored_webhook_secret(current)
        if current.webhook_url == url and not secret_changed:
            return False
        current.webhook_url = url
        if secret is not None:
            current.webhook_secret = secret
        current.save(update_fields=["webhook_url", "webhook_secret_encrypted"])
        detail = {"url": url, "secret_changed": secret_changed}
        _agent_event(agent.name, actor=actor, action="agent.webhook_changed", detail=detail)
    agent.refresh_from_db()
    return True


def agent_webhook_secret(*, agent: Agent) -> str:
    """The key that signs the agent's alerts and its calls' callbacks, created (and audited as
    `agent.webhook_secret_created`, without its value) when the agent has none, so that no
    delivery goes unsigned. Raises InvalidRequest when the stored key no longer decrypts
    (SIGIL_SECRETS_KEY changed): the owner sets one again. Idempotent: two callers at once get
    the same key."""
    secret = agent.webhook_secret
    if secret:
        return secret
    with transaction.atomic():
        current = Agent.objects.select_for_update().get(pk=agent.pk)
        secret = current.webhook_secret
        if not secret:
            secret = "whsec_" + secrets.token_urlsafe(32)
            current.webhook_secret = secret
            current.save(update_fields=["webhook_secret_encrypted"])
            _agent_event(agent.name, actor="system", action="agent.webhook_secret_created")
    agent.webhook_secret_encrypted = current.webhook_secret_encrypted
    return secret


def agent_set_a2a(*, agent: Agent, url: str, actor: str) -> bool:
    """Set the URL of the agent's A2A Agent Card ("" removes it): its alerts are then also sent
    there as A2A messages. Returns False when nothing changed. Raises InvalidRequest for a URL
    that is not http(s), or that names a private or reserved address: the agent itself may set
    it, so it follows the rules of its callbacks (agents.egress, SIGIL_CALLBACK_ALLOWED_NETWORKS)."""
    if url:
        try:
            URLValidator(schemes=["http", "https"])(url)
        except ValidationError as exc:
            raise InvalidRequest(f"A2A Agent Card URL {url!r} is not an http(s) URL") from exc
        refusal = egress.callback_refusal(url, resolve=False)
        if refusal:
            raise InvalidRequest(refusal.replace("X-Callback-Url", "the A2A Agent Card URL"))
    with transaction.atomic():
        current = Agent.objects.select_for_update().get(pk=agent.pk)
        if current.a2a_card_url == url:
            return False
        current.a2a_card_url = url
        current.save(update_fields=["a2a_card_url"])
        _agent_event(agent.name, actor=actor, action="agent.a2a_changed", detail={"url": url})
    agent.refresh_from_db()
    return True


def _stored_webhook_secret(agent: Agent) -> str | None:
    """The agent's webhook key, or None when it no longer decrypts (SIGIL_SECRETS_KEY changed):
    any key the owner sets then is a change."""
    try:
        return agent.webhook_secret
    except InvalidRequest:
        return None


def _write_tombstones(hashes: list[str], *, delete: bool = False, value: bytes = tokens.TOMBSTONE) -> None:
    """Write (or drop) the tokens' Redis copies, and mark their copies at the edge, which the
    publisher writes from the database."""
    if not hashes:
        return
    edge_mark(*(token_key(token_hash) for token_hash in hashes))
    pipe = get_redis().pipeline(transaction=False)
    for token_hash in hashes:
        if delete:
            pipe.delete(redis_keys.token(token_hash))
        else:
            pipe.set(redis_keys.token(token_hash), value, ex=tokens.POSITIVE_TTL_SECONDS)
    pipe.execute()


class WebhookUnavailable(Exception):
    """The agent's webhook did not answer, or answered 5xx: worth another try later."""


def webhook_signature(secret: str, body: bytes) -> str:
    """`sha256=<hex>`: the HMAC-SHA256 of the exact body, keyed with the agent's secret."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def agent_notify(*, agent_name: str, event: str, payload: dict) -> bool:
    """Queue the alert's deliveries to the agent, after the current transaction commits: a
    signed webhook to its webhook URL, and an A2A message to its Agent Card's agent.

    Returns False (and sends nothing) when the agent has neither.
    """
    agent = Agent.objects.filter(name=agent_name).first()
    if agent is None or not (agent.webhook_url or agent.a2a_card_url):
        return False
    delivery = {
        "id": str(uuid.uuid4()),
        "event": event,
        "agent": agent_name,
        "sent_at": timezone.now().isoformat(),
        **payload,
    }
    if agent.webhook_url:
        jobs.agent_webhook_deliver.delay_on_commit(agent_id=agent.pk, delivery=delivery)
    if agent.a2a_card_url:
        jobs.agent_a2a_deliver.delay_on_commit(agent_id=agent.pk, delivery=delivery)
    return True


def alert_text(delivery: dict) -> str:
    """One line saying what an alert is about, for a reader (an A2A message's text part)."""
    capability = delivery.get("capability", "")
    said = {
        "capability.error_rate_alert": "errors spiked",
        "capability.degraded": "is degraded: its breaker opened after repeated failures",
        "capability.split_aborted": "had its traffic split aborted",
        "capability.inactive": "was marked inactive",
    }.get(delivery["event"], delivery["event"])
    text = f"Sigil: {capability} {said}." if capability else f"Sigil: {said}."
    if delivery.get("request_ids"):
        text += f" Request ids: {', '.join(delivery['request_ids'])}."
    if delivery.get("logs"):
        text += f" Call records: {delivery['logs']}"
    return text


def agent_a2a_deliver(*, agent_id: int, delivery: dict) -> None:
    """Send one alert to the agent's A2A Agent Card's agent as an A2A message. Raises
    A2aUnavailable when a retry may succeed; a refusal is final and audited as refused. The
    card URL, and the endpoint the card names, are checked against the egress rules when it is
    sent (a host may resolve elsewhere now)."""
    agent = Agent.objects.filter(pk=agent_id).first()
    if agent is None or not agent.a2a_card_url:
        return
    url = agent.a2a_card_url
    subject = delivery.get("capability", "")
    try:
        refusal = egress.callback_refusal(url, resolve=True)
    except OSError as exc:
        raise a2a.A2aUnavailable(f"{url}: cannot resolve its host ({exc})") from exc
    try:
        if refusal:
            raise a2a.A2aRefused(refusal.replace("X-Callback-Url", "the A2A Agent Card URL"))
        answered = a2a.a2a_send(card_url=url, text=alert_text(delivery), data=delivery, message_id=delivery["id"])
    except a2a.A2aRefused as exc:
        audit_record(
            actor="system",
            action="a2a.refused",
            agent_name=agent.name,
            subject=subject,
            detail={"event": delivery["event"], "delivery": delivery["id"], "reason": str(exc)},
        )
        return
    audit_record(
        actor="system",
        action="a2a.delivered",
        agent_name=agent.name,
        subject=subject,
        detail={"event": delivery["event"], "delivery": delivery["id"], "answered": answered},
    )


def agent_webhook_deliver(*, agent_id: int, delivery: dict, url: str = "") -> None:
    """POST one delivery to `url` (a call's callback), else to the agent's webhook, signed
    with the agent's webhook secret. Raises WebhookUnavailable when a retry may succeed; a
    4xx answer, or a callback to an address it may not reach (agents.egress), is final and
    audited as refused."""
    agent = Agent.objects.filter(pk=agent_id).first()
    target = url or (agent.webhook_url if agent else "")
    if agent is None or not target:
        return
    if url:  # a callback the agent named, checked again now against what its name resolves to
        try:
            refusal = egress.callback_refusal(url, resolve=True)
        except OSError as exc:
            raise WebhookUnavailable(f"{url}: cannot resolve its host ({exc})") from exc
        if refusal:
            _callback_refused(agent, delivery, refusal)
            return
    body = json.dumps(delivery, separators=(",", ":"), sort_keys=True).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "sigil-webhook",
        "X-Sigil-Event": delivery["event"],
        "X-Sigil-Delivery": delivery["id"],
    }
    try:
        secret = agent_webhook_secret(agent=agent)
    except InvalidRequest as exc:
        # SIGIL_SECRETS_KEY changed: a delivery unsigned, or signed with another key, would mislead.
        reason = f"{exc.message}; set the webhook secret again"
        agent_delivery_failed(agent_id=agent.pk, delivery=delivery, reason=reason)
        return
    headers["X-Sigil-Signature"] = webhook_signature(secret, body)
    # A callback connects only to an address that passes the same check (agents.egress).
    session = egress.checked_session() if url else requests
    try:
        response = session.post(target, data=body, headers=headers, timeout=10, allow_redirects=False)
    except egress.CallbackRefused as exc:
        _callback_refused(agent, delivery, f"X-Callback-Url names {exc}")
        return
    except requests.RequestException as exc:
        raise WebhookUnavailable(f"{target}: {exc.__class__.__name__}") from exc
    if response.status_code >= 500:
        raise WebhookUnavailable(f"{target} answered {response.status_code}")
    ok = response.status_code < 300
    audit_record(
        actor="system",
        action="webhook.delivered" if ok else "webhook.refused",
        agent_name=agent.name,
        subject=delivery.get("capability", ""),
        detail={"event": delivery["event"], "delivery": delivery["id"], "status": response.status_code},
    )


def _callback_refused(agent: Agent, delivery: dict, reason: str) -> None:
    audit_record(
        actor="system",
        action="webhook.refused",
        agent_name=agent.name,
        subject=delivery.get("capability", ""),
        detail={"event": delivery["event"], "delivery": delivery["id"], "reason": reason},
    )


def agent_delivery_failed(*, agent_id: int, delivery: dict, reason: str, channel: str = "webhook") -> None:
    """Record a delivery given up (after its last retry, or as one that cannot be signed), so
    the owner sees it in the trail as `{channel}.failed`: `webhook` (a webhook or a call's
    callback) or `a2a`."""
    agent = Agent.objects.filter(pk=agent_id).first()
    audit_record(
        actor="system",
        action=f"{channel}.failed",
        agent_name=agent.name if agent else "",
        subject=delivery.get("capability", ""),
        detail={"event": delivery.get("event"), "delivery": delivery.get("id"), "reason": reason},
    )
