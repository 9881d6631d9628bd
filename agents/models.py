"""Agents, their scoped tokens, and the audit trail of everything done in Sigil."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from agents import tokens
from sigil.encryption import secret_decrypt, secret_encrypt


class Agent(models.Model):
    """An AI agent: owns the capabilities under its name prefix (`{name}--*`)."""

    name = models.CharField(max_length=31, unique=True)
    is_active = models.BooleanField(default=True, help_text="A disabled agent's tokens stop working at once.")
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    webhook_url = models.URLField(
        blank=True, help_text="Where Sigil posts this agent's alerts (breaker opened, error rate, inactive)."
    )
    # The key of the HMAC-SHA256 in each delivery's X-Sigil-Signature header, shared with the
    # agent: encrypted at rest (sigil.encryption); read and set as `webhook_secret`.
    webhook_secret_encrypted = models.TextField(blank=True, editable=False)
    # This agent's own shares of each web process (capabilities/engine/shares.py); empty: the
    # SIGIL_AGENT_* defaults.
    max_calls_in_flight = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Most calls in flight per web process; empty: SIGIL_AGENT_CALLS_IN_FLIGHT.",
    )
    max_placements_in_flight = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Most placements under way per web process; empty: SIGIL_AGENT_PLACEMENTS_IN_FLIGHT.",
    )
    a2a_card_url = models.URLField(
        "A2A Agent Card URL",
        blank=True,
        max_length=500,
        help_text="The agent's A2A Agent Card: its alerts are also sent there as A2A messages.",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def webhook_secret(self) -> str:
        """The webhook's signing key in plain text ("": none). Raises InvalidRequest when
        SIGIL_SECRETS_KEY changed since it was stored."""
        return secret_decrypt(self.webhook_secret_encrypted) if self.webhook_secret_encrypted else ""

    @webhook_secret.setter
    def webhook_secret(self, plain: str) -> None:
        self.webhook_secret_encrypted = secret_encrypt(plain) if plain else ""


class Scope(models.TextChoices):
    DEPLOY = "deploy", "deploy"
    INVOKE = "invoke", "invoke"


class Token(models.Model):
    """A bearer token of one agent with one scope. Only its sha256 is stored."""

    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="tokens")
    scope = models.CharField(max_length=8, choices=Scope.choices)
    label = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, editable=False, help_text="The first characters, to recognise it.")
    secret_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.agent.name}, {self.scope})"

    def state(self, now_epoch: float) -> tokens.TokenState:
        """Usable, revoked or expired at `now_epoch` (the rule: agents.tokens.token_state)."""
        expires = self.expires_at.timestamp() if self.expires_at else None
        return tokens.token_state(revoked=self.revoked_at is not None, expires_epoch=expires, now_epoch=now_epoch)


class AuditEvent(models.Model):
    """Who did what to which capability, token or agent, and when.

    The subject is named by text (a capability's full name, a token's prefix), so the
    trail outlives the rows it speaks of.
    """

    created_at = models.DateTimeField(default=timezone.now, db_index=True, editable=False)
    actor = models.CharField(max_length=100, help_text="agent:NAME, owner:USERNAME or system")
    agent_name = models.CharField(max_length=31, db_index=True, blank=True)
    action = models.CharField(max_length=40, db_index=True)
    subject = models.CharField(max_length=100, db_index=True, blank=True)
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.subject}"
