"""The owner's console for agents, tokens and the audit trail."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.db.models import Count, Q, Sum
from django.http import HttpResponseNotAllowed, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.http import urlencode

from agents import egress, services, tokens
from agents.models import Agent, AuditEvent, Token
from agents.names import validate_agent_name
from agents.tokens import TokenState
from sigil import redis_keys
from sigil.console import (
    ButtonsOnly,
    OptionsFilter,
    RefusalsAsMessages,
    SelectionChecked,
    confirm_page,
    confirmed,
    fragment,
    owner_actor,
)
from sigil.errors import SigilError
from sigil.redis_client import get_redis

# The state of a capability that is gone (capabilities.models.State.REMOVED); named here
# because agents never imports capabilities.
REMOVED = "removed"
# The label of the two tokens an agent created in the admin comes with.
ADMIN_TOKEN_LABEL = "created with the agent"


class TokenInline(admin.TabularInline):
    model = Token
    extra = 0
    can_delete = False
    fields = ["prefix", "scope", "label", "created_at", "expires_at", "revoked_at", "last_used_at"]
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False


class AgentForm(forms.ModelForm):
    webhook_url = forms.URLField(
        required=False,
        assume_scheme="https",
        help_text=Agent._meta.get_field("webhook_url").help_text,
    )
    new_webhook_secret = forms.CharField(
        required=False,
        label="New webhook secret",
        widget=forms.PasswordInput(render_value=False),
        help_text="The HMAC-SHA256 key of the X-Sigil-Signature header, shared with the agent. "
        "Leave empty to keep the current one; with none, Sigil creates one when a delivery needs it "
        "(the agent reads it at GET /_api/agent/webhook).",
    )
    clear_webhook_secret = forms.BooleanField(required=False, label="Remove the webhook secret")

    a2a_card_url = forms.URLField(
        required=False,
        assume_scheme="https",
        label="A2A Agent Card URL",
        help_text=Agent._meta.get_field("a2a_card_url").help_text,
    )

    class Meta:
        model = Agent
        fields = ["name", "webhook_url", "a2a_card_url"]

    def clean_a2a_card_url(self) -> str:
        url = self.cleaned_data.get("a2a_card_url") or ""
        refusal = egress.callback_refusal(url, resolve=False) if url else None
        if refusal:
            raise forms.ValidationError(refusal.replace("X-Callback-Url", "The A2A Agent Card URL"))
        return url

    def clean_name(self):
        # The naming rule, said on the field (the service checks it again, with the limit).
        name = self.cleaned_data.get("name")
        if self.instance.pk is None:
            try:
                validate_agent_name(name)
            except SigilError as exc:
                raise forms.ValidationError(exc.message) from exc
        return name


@admin.register(Agent)
class AgentAdmin(SelectionChecked, RefusalsAsMessages, admin.ModelAdmin):
    form = AgentForm
    list_display = ["name", "is_active", "capability_count", "calls", "errors", "has_webhook", "created_at"]
    list_filter = ["is_active"]
    search_fields = ["name"]
    inlines = [TokenInline]
    actions = ["disable_agents", "enable_agents"]

    def get_queryset(self, request):
        # Not removed, and no split's staged version (a row of its own, shown on its capability's page).
        current = ~Q(capabilities__state=REMOVED) & Q(capabilities__variant_of__isnull=True)
        return (
            super()
            .get_queryset(request)
            .annotate(
                capability_count=Count("capabilities", filter=current),
                calls=Sum("capabilities__calls_total"),
                errors=Sum("capabilities__errors_total"),
            )
        )

    @admin.display(description="capabilities", ordering="capability_count")
    def capability_count(self, agent: Agent) -> str:
        query = urlencode({"agent__id__exact": agent.pk})
        return fragment("admin/agents/agent/capability_count.html", query=query, count=agent.capability_count)

    @admin.display(description="calls (all time)", ordering="calls")
    def calls(self, agent: Agent) -> int:
        return agent.calls or 0

    @admin.display(description="errors (all time)", ordering="errors")
    def errors(self, agent: Agent) -> int:
        return agent.errors or 0

    @admin.display(description="webhook", boolean=True)
    def has_webhook(self, agent: Agent) -> bool:
        return bool(agent.webhook_url)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["name"]
        return [
            "name",
            "is_active",
            "created_at",
            "links",
            "capabilities_panel",
            "webhook_url",
            "webhook_secret_state",
            "new_webhook_secret",
            "clear_webhook_secret",
            "max_calls_in_flight",
            "max_placements_in_flight",
            "a2a_card_url",
        ]

    def get_readonly_fields(self, request, obj=None):
        # The name is the capabilities' prefix: fixed once the agent exists. Activity is
        # changed with the actions, which go through agent_set_active.
        if obj is None:
            return []
        return ["name", "is_active", "created_at", "links", "capabilities_panel", "webhook_secret_state"]

    @admin.display(description="shortcuts")
    def links(self, agent: Agent) -> str:
        return fragment(
            "admin/agents/agent/links.html",
            issue_query=urlencode({"agent": agent.pk}),
            trail_query=urlencode({"agent_name": agent.name}),
        )

    @admin.display(description="capabilities")
    def capabilities_panel(self, agent: Agent) -> str:
        rows = agent.capabilities.exclude(state=REMOVED).filter(variant_of__isnull=True).order_by("full_name")
        if not rows:
            return "none"
        return fragment("admin/agents/agent/capabilities_panel.html", capabilities=rows)

    @admin.display(description="webhook secret")
    def webhook_secret_state(self, agent: Agent) -> str:
        return "set (not shown)" if agent.webhook_secret_encrypted else "none: deliveries are not signed"

    def save_model(self, request, obj, form, change) -> None:
        if not change:
            # The agent comes with what it needs to deploy and call, as `createagent` gives it.
            created = services.agent_create_with_tokens(
                name=obj.name, actor=owner_actor(request), label=ADMIN_TOKEN_LABEL
            )
            obj.pk = created.agent.pk
            obj.created_at = created.agent.created_at
            for token, secret in (created.deploy, created.invoke):
                issued_secret_keep(request, token, secret)
            obj.issued_tokens = [created.deploy[0].pk, created.invoke[0].pk]
            return
        if form.cleaned_data.get("clear_webhook_secret"):
            secret = ""
        else:
            secret = form.cleaned_data.get("new_webhook_secret") or None
        agent = Agent.objects.get(pk=obj.pk)
        services.agent_set_webhook(agent=agent, url=obj.webhook_url, secret=secret, actor=owner_actor(request))
        services.agent_set_shares(
            agent=agent,
            calls_in_flight=obj.max_calls_in_flight,
            placements_in_flight=obj.max_placements_in_flight,
            actor=owner_actor(request),
        )
        services.agent_set_a2a(agent=agent, url=obj.a2a_card_url, actor=owner_actor(request))

    def response_add(self, request, obj, post_url_continue=None):
        # POST, redirect, GET, as for one token: reloading the page that shows the secrets issues nothing.
        query = urlencode({"tokens": ",".join(str(pk) for pk in obj.issued_tokens)})
        return HttpResponseRedirect(f"{reverse('admin:agents_agent_created', args=[obj.pk])}?{query}")

    def created_view(self, request, object_id):
        """The page that shows a new agent's two tokens, once: to the session that created it,
        within ISSUED_SECRET_SECONDS; reloaded, it says the secrets are gone."""
        agent = get_object_or_404(Agent, pk=object_id)
        if not self.has_view_permission(request, agent):
            return HttpResponseRedirect(reverse("admin:index"))
        wanted = [int(pk) for pk in request.GET.get("tokens", "").split(",") if pk.isdigit() and len(pk) < 19]
        issued = [
            (token, issued_secret_take(request, token))
            for token in agent.tokens.filter(pk__in=wanted).order_by("scope")
        ]
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Agent {agent.name} created",
            "agent": agent,
            "issued": issued,
            "base_url": request.build_absolute_uri("/").rstrip("/"),
        }
        response = TemplateResponse(request, "admin/agents/agent/created.html", context)
        response["Cache-Control"] = "no-store"
        return response

    def get_urls(self):
        created = self.admin_site.admin_view(self.created_view)
        return [path("<path:object_id>/created/", created, name="agents_agent_created"), *super().get_urls()]

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # capabilities and the audit trail refer to agents; disable instead

    @admin.action(description="Disable selected agents (their tokens stop at once)…")
    def disable_agents(self, request, queryset):
        what = (
            "Every token of theirs is refused from the next request on: their calls, deploys and MCP "
            "sessions stop. Their capabilities stay, and enabling them again restores the tokens."
        )
        return self._set_active(request, queryset, is_active=False, action="Disable the selected agents", what=what)

    @admin.action(description="Enable selected agents…")
    def enable_agents(self, request, queryset):
        what = "Their tokens that are neither revoked nor expired work again from the next request on."
        return self._set_active(request, queryset, is_active=True, action="Enable the selected agents", what=what)

    def _set_active(self, request, queryset, *, is_active: bool, action: str, what: str):
        """Enable or disable each agent through the service, once the owner confirmed (the
        confirmation page posts the selection back); each change goes to the admin's history too."""
        agents = list(queryset.order_by("name"))
        if not confirmed(request):
            subject = ", ".join(a.name for a in agents) or "no agent"
            return confirm_page(
                self, request, action=action, subject=subject, what=what, selected=[a.pk for a in agents]
            )
        count = 0
        for agent in agents:
            if services.agent_set_active(agent=agent, is_active=is_active, actor=owner_actor(request)):
                count += 1
                self.log_change(request, agent, "Enabled" if is_active else "Disabled")
        self.message_user(request, f"{'Enabled' if is_active else 'Disabled'} {count} agent(s).")
        return None


# How long a token's secret waits for the page that shows it (the redirect after issuing).
ISSUED_SECRET_SECONDS = 120


def _issued_key(request, token: Token) -> str:
    # Bound to the session that issued it: another owner's session cannot read it.
    if not request.session.session_key:
        request.session.save()
    return redis_keys.token_issued(token.pk, hashlib.sha256(request.session.session_key.encode()).hexdigest())


def issued_secret_keep(request, token: Token, secret: str) -> None:
    """Hand a new token's secret to the page the redirect opens: in Redis for a moment, never
    in the database, the session or a message."""
    get_redis().set(_issued_key(request, token), secret, ex=ISSUED_SECRET_SECONDS)


def issued_secret_take(request, token: Token) -> str | None:
    """The secret kept for this session's page, gone once read (None when already shown)."""
    pipe = get_redis().pipeline(transaction=True)
    key = _issued_key(request, token)
    pipe.get(key)
    pipe.delete(key)
    secret, _ = pipe.execute()
    return secret.decode() if secret is not None else None


class TokenCreationForm(forms.ModelForm):
    class Meta:
        model = Token
        fields = ["agent", "scope", "label", "expires_at"]

    def clean_expires_at(self):
        expires_at = self.cleaned_data.get("expires_at")
        if expires_at is not None and expires_at <= timezone.now():
            raise forms.ValidationError("the expiry must be in the future")
        return expires_at


class TokenStateFilter(OptionsFilter):
    title = "state"
    parameter_name = "state"
    options = {
        "usable": ("usable", lambda: tokens.state_filter(TokenState.USABLE, timezone.now())),
        "expiring": (
            "expiring within 7 days",
            lambda: tokens.state_filter(TokenState.USABLE, timezone.now())
            & Q(expires_at__lte=timezone.now() + timedelta(days=7)),
        ),
        "revoked": ("revoked", lambda: tokens.state_filter(TokenState.REVOKED, timezone.now())),
        "expired": ("expired", lambda: tokens.state_filter(TokenState.EXPIRED, timezone.now())),
    }


@admin.register(Token)
class TokenAdmin(ButtonsOnly, SelectionChecked, RefusalsAsMessages, admin.ModelAdmin):
    list_display = ["prefix", "agent", "scope", "label", "state", "created_at", "expires_at", "last_used_at"]
    list_filter = [TokenStateFilter, "scope", "agent"]
    list_select_related = ["agent"]
    search_fields = ["prefix", "label", "agent__name"]
    readonly_fields = ["agent", "scope", "label", "prefix", "created_at", "expires_at", "revoked_at", "last_used_at"]
    actions = ["revoke_tokens"]
    change_form_template = "admin/agents/token/change_form.html"

    @admin.display(description="state")
    def state(self, token: Token) -> str:
        return token.state(time.time())

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = TokenCreationForm
        return super().get_form(request, obj, **kwargs)

    def get_readonly_fields(self, request, obj=None):
        return self.readonly_fields if obj else []

    def get_fields(self, request, obj=None):
        return self.readonly_fields if obj else ["agent", "scope", "label", "expires_at"]

    def save_model(self, request, obj, form, change) -> None:
        if change:
            return
        token, secret = services.token_issue(
            agent=obj.agent,
            scope=obj.scope,
            label=obj.label,
            expires_at=obj.expires_at,
            actor=owner_actor(request),
        )
        obj.pk = token.pk
        obj.prefix = token.prefix
        obj.created_at = token.created_at
        issued_secret_keep(request, token, secret)

    def response_add(self, request, obj, post_url_continue=None):
        # POST, redirect, GET: reloading the page that shows the secret issues nothing.
        return HttpResponseRedirect(reverse("admin:agents_token_issued", args=[obj.pk]))

    def issued_view(self, request, object_id):
        """The page that shows a token's secret, once: to the session that issued it, within
        ISSUED_SECRET_SECONDS; reloaded, it says the secret is gone."""
        token = get_object_or_404(Token.objects.select_related("agent"), pk=object_id)
        if not self.has_view_permission(request, token):
            return HttpResponseRedirect(reverse("admin:index"))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Token issued",
            "token": token,
            "secret": issued_secret_take(request, token),
        }
        response = TemplateResponse(request, "admin/agents/token/issued.html", context)
        response["Cache-Control"] = "no-store"
        return response

    def get_urls(self):
        revoke = self.admin_site.admin_view(self.revoke_view)
        issued = self.admin_site.admin_view(self.issued_view)
        return [
            path("<path:object_id>/revoke/", revoke, name="agents_token_revoke"),
            path("<path:object_id>/issued/", issued, name="agents_token_issued"),
            *super().get_urls(),
        ]

    def revoke_view(self, request, object_id):
        """Revoke one token: GET asks (the confirmation page), POST revokes."""
        if request.method not in ("GET", "POST"):
            return HttpResponseNotAllowed(["GET", "POST"])
        token = get_object_or_404(Token.objects.select_related("agent"), pk=object_id)
        if not self.has_change_permission(request, token):
            return HttpResponseRedirect(reverse("admin:index"))
        token_url = reverse("admin:agents_token_change", args=[token.pk])
        if request.method == "GET":
            what = (
                f"Every call and deploy with it is refused from the next request on; {token.agent.name}'s "
                "other tokens keep working. A revoked token cannot be restored."
            )
            subject = f"{token.prefix}… of {token.agent.name}"
            return confirm_page(
                self, request, action="Revoke this token", subject=subject, subject_url=token_url, what=what
            )
        if services.token_revoke(token=token, actor=owner_actor(request)):
            self.log_change(request, token, "Revoked")
            self.message_user(request, f"Revoked token {token.prefix}… of {token.agent.name}.")
        else:
            self.message_user(request, f"Token {token.prefix}… was already revoked.", level=messages.WARNING)
        return HttpResponseRedirect(reverse("admin:agents_token_change", args=[token.pk]))

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # revoke instead, so the trail keeps the token's prefix

    @admin.action(description="Revoke selected tokens…")
    def revoke_tokens(self, request, queryset):
        tokens = list(queryset.select_related("agent"))
        if not confirmed(request):
            # Asked first, as for one token: a revoked token cannot be restored.
            what = (
                "Every call and deploy with them is refused from the next request on; their agents' other "
                "tokens keep working. A revoked token cannot be restored."
            )
            subject = ", ".join(f"{t.prefix}… of {t.agent.name}" for t in tokens) or "no token"
            selected = [t.pk for t in tokens]
            return confirm_page(
                self, request, action="Revoke the selected tokens", subject=subject, what=what, selected=selected
            )
        count = 0
        for token in tokens:
            try:
                revoked = services.token_revoke(token=token, actor=owner_actor(request))
            except SigilError as exc:
                self.message_user(request, f"{token.prefix}…: {exc.message}", level=messages.ERROR)
                continue
            if revoked:
                count += 1
                self.log_change(request, token, "Revoked")
        self.message_user(request, f"Revoked {count} token(s).")
        return None


class AuditSubjectFilter(admin.SimpleListFilter):
    """Capabilities by full name (their subjects contain the `--` separator)."""

    title = "capability"
    parameter_name = "subject"

    def lookups(self, request, model_admin):
        subjects = model_admin.get_queryset(request).filter(subject__contains="--")
        agent = request.GET.get("agent_name")
        if agent:
            subjects = subjects.filter(agent_name=agent)
        names = subjects.order_by("subject").values_list("subject", flat=True).distinct()[:100]
        return [(name, name) for name in names]

    def queryset(self, request, queryset):
        return queryset.filter(subject=self.value()) if self.value() else queryset


def _within(span: timedelta) -> Callable[[], Q]:
    return lambda: Q(created_at__gte=timezone.now() - span)


class AuditTimeFilter(OptionsFilter):
    title = "time"
    parameter_name = "within"
    options = {
        "1h": ("last hour", _within(timedelta(hours=1))),
        "24h": ("last 24 hours", _within(timedelta(days=1))),
        "7d": ("last 7 days", _within(timedelta(days=7))),
        "30d": ("last 30 days", _within(timedelta(days=30))),
    }


@admin.register(AuditEvent)
class AuditEventAdmin(SelectionChecked, admin.ModelAdmin):
    list_display = ["created_at", "actor", "action", "agent_name", "subject_link", "detail_summary"]
    list_filter = [AuditTimeFilter, "action", "agent_name", AuditSubjectFilter]
    search_fields = ["subject", "actor", "agent_name", "action"]
    date_hierarchy = "created_at"
    readonly_fields = ["created_at", "actor", "action", "agent_name", "subject", "detail"]
    list_per_page = 50

    @admin.display(description="subject", ordering="subject")
    def subject_link(self, event: AuditEvent) -> str:
        if not event.subject:
            return ""
        query = urlencode({"subject": event.subject})
        return fragment("admin/agents/auditevent/subject.html", query=query, subject=event.subject)

    @admin.display(description="detail")
    def detail_summary(self, event: AuditEvent) -> str:
        text = ", ".join(f"{key}={value}" for key, value in event.detail.items())
        return text if len(text) <= 80 else text[:79] + "…"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
