"""The owner's console for agents, tokens and the audit trail."""

from __future__ import annotations

import hashlib
from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import ValidationError
from django.db.models import Count, Q, Sum
from django.http import HttpResponseNotAllowed, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from agents import egress, services
from agents.models import Agent, AuditEvent, Token
from agents.names import validate_agent_name
from sigil.errors import SigilError
from sigil.redis_client import get_redis

# The state of a capability that is gone (capabilities.models.State.REMOVED); named here
# because agents never imports capabilities.
REMOVED = "removed"


def owner_actor(request) -> str:
    return f"owner:{request.user.get_username()}"


class RefusalsAsMessages:
    """A service's refusal while an admin form saves (or a delete page deletes) is said as an
    error message above the form it came from, never a 500: the service call runs after the
    form validated, inside the admin's transaction, which the refusal rolls back."""

    refusals: tuple[type[Exception], ...] = (SigilError,)

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except self.refusals as exc:
            return self._refused(request, exc)

    def delete_view(self, request, object_id, extra_context=None):
        try:
            return super().delete_view(request, object_id, extra_context)
        except self.refusals as exc:
            return self._refused(request, exc)

    def _refused(self, request, exc: Exception) -> HttpResponseRedirect:
        self.message_user(request, getattr(exc, "message", None) or str(exc), level=messages.ERROR)
        return HttpResponseRedirect(request.get_full_path())


class SelectionChecked:
    """A list action posted with a selection that names no row (an id that is no number, or
    past a 64-bit integer) is said as a message instead of a 500: Django filters the list by
    the posted ids as they come, and the database refuses such values."""

    def response_action(self, request, queryset):
        pk = self.model._meta.pk
        for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
            try:
                number = pk.to_python(value)
            except ValidationError:
                number = None
            if number is None or (isinstance(number, int) and not -(2**63) <= number < 2**63):
                self.message_user(request, f"The selection names no {self.opts.verbose_name}.", level=messages.ERROR)
                return HttpResponseRedirect(request.get_full_path())
        return super().response_action(request, queryset)


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
        "Leave empty to keep the current one.",
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
        url = reverse("admin:capabilities_capability_changelist") + "?" + urlencode({"agent__id__exact": agent.pk})
        return format_html('<a href="{}">{}</a>', url, agent.capability_count)

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
        issue = reverse("admin:agents_token_add") + "?" + urlencode({"agent": agent.pk})
        trail = reverse("admin:agents_auditevent_changelist") + "?" + urlencode({"agent_name": agent.name})
        return format_html(
            '<a class="button" href="{}">Issue a token</a> <a class="button" href="{}">Audit trail</a>', issue, trail
        )

    @admin.display(description="capabilities")
    def capabilities_panel(self, agent: Agent) -> str:
        rows = agent.capabilities.exclude(state=REMOVED).filter(variant_of__isnull=True).order_by("full_name")
        if not rows:
            return "none"
        body = format_html_join(
            "",
            '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>'
            "<td>{}</td></tr>",
            (
                (
                    reverse("admin:capabilities_capability_change", args=[c.pk]),
                    c.full_name,
                    c.type,
                    c.get_state_display(),
                    "public" if c.is_public else "private",
                    "degraded" if c.breaker_state == "open" else "ok",
                    c.calls_total,
                    c.errors_total,
                    c.last_access_at.strftime("%Y-%m-%d %H:%M") if c.last_access_at else "never",
                )
                for c in rows
            ),
        )
        return format_html(
            '<div class="sigil-wide"><table id="agent-capabilities"><thead><tr><th>capability</th><th>type</th>'
            "<th>state</th>"
            "<th>visibility</th><th>breaker</th><th>calls</th><th>errors</th><th>last access</th></tr></thead>"
            "<tbody>{}</tbody></table></div>",
            body,
        )

    @admin.display(description="webhook secret")
    def webhook_secret_state(self, agent: Agent) -> str:
        return "set (not shown)" if agent.webhook_secret_encrypted else "none: deliveries are not signed"

    def save_model(self, request, obj, form, change) -> None:
        if not change:
            created = services.agent_create(name=obj.name, actor=owner_actor(request))
            obj.pk = created.pk
            obj.created_at = created.created_at
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
        if request.POST.get("confirmed") != "yes":
            changelist_url = reverse("admin:agents_agent_changelist")
            context = {
                **self.admin_site.each_context(request),
                "opts": self.opts,
                "title": f"{action}: are you sure?",
                "subject": ", ".join(a.name for a in agents) or "no agent",
                "subject_url": changelist_url,
                "changelist_url": changelist_url,
                "action": action,
                "what": what,
                "fields": {"action": request.POST.get("action", ""), "confirmed": "yes"},
                "selected": [a.pk for a in agents],
            }
            return TemplateResponse(request, "admin/sigil/confirm.html", context)
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
    return f"sigil:token-issued:{token.pk}:{hashlib.sha256(request.session.session_key.encode()).hexdigest()}"


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


class TokenStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [
            ("usable", "usable"),
            ("expiring", "expiring within 7 days"),
            ("revoked", "revoked"),
            ("expired", "expired"),
        ]

    def queryset(self, request, queryset):
        now = timezone.now()
        if self.value() == "usable":
            return queryset.filter(revoked_at__isnull=True).exclude(expires_at__lte=now)
        if self.value() == "expiring":
            return queryset.filter(revoked_at__isnull=True, expires_at__gt=now, expires_at__lte=now + timedelta(days=7))
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        if self.value() == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        return queryset


@admin.register(Token)
class TokenAdmin(SelectionChecked, RefusalsAsMessages, admin.ModelAdmin):
    list_display = ["prefix", "agent", "scope", "label", "state", "created_at", "expires_at", "last_used_at"]
    list_filter = [TokenStateFilter, "scope", "agent"]
    list_select_related = ["agent"]
    search_fields = ["prefix", "label", "agent__name"]
    readonly_fields = ["agent", "scope", "label", "prefix", "created_at", "expires_at", "revoked_at", "last_used_at"]
    actions = ["revoke_tokens"]
    change_form_template = "admin/agents/token/change_form.html"

    @admin.display(description="state")
    def state(self, token: Token) -> str:
        if token.revoked_at is not None:
            return "revoked"
        if token.expires_at is not None and token.expires_at <= timezone.now():
            return "expired"
        return "usable"

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

    def change_view(self, request, object_id, form_url="", extra_context=None):
        # A token cannot be edited: it is revoked with the button, or issued anew.
        extra_context = {
            **(extra_context or {}),
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
        }
        return super().change_view(request, object_id, form_url, extra_context)

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
            context = {
                **self.admin_site.each_context(request),
                "opts": self.opts,
                "title": "Revoke this token: are you sure?",
                "subject": f"{token.prefix}… of {token.agent.name}",
                "subject_url": token_url,
                "changelist_url": reverse("admin:agents_token_changelist"),
                "action": "Revoke this token",
                "what": f"Every call and deploy with it is refused from the next request on; {token.agent.name}'s "
                "other tokens keep working. A revoked token cannot be restored.",
                "fields": {},
            }
            return TemplateResponse(request, "admin/sigil/confirm.html", context)
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
        if request.POST.get("confirmed") != "yes":
            # Asked first, as for one token: a revoked token cannot be restored.
            changelist_url = reverse("admin:agents_token_changelist")
            context = {
                **self.admin_site.each_context(request),
                "opts": self.opts,
                "title": "Revoke the selected tokens: are you sure?",
                "subject": ", ".join(f"{t.prefix}… of {t.agent.name}" for t in tokens) or "no token",
                "subject_url": changelist_url,
                "changelist_url": changelist_url,
                "action": "Revoke the selected tokens",
                "what": "Every call and deploy with them is refused from the next request on; their agents' other "
                "tokens keep working. A revoked token cannot be restored.",
                "fields": {"action": request.POST.get("action", ""), "confirmed": "yes"},
                "selected": [t.pk for t in tokens],
            }
            return TemplateResponse(request, "admin/sigil/confirm.html", context)
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


class AuditTimeFilter(admin.SimpleListFilter):
    title = "time"
    parameter_name = "within"
    SPANS = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7), "30d": timedelta(days=30)}

    def lookups(self, request, model_admin):
        return [("1h", "last hour"), ("24h", "last 24 hours"), ("7d", "last 7 days"), ("30d", "last 30 days")]

    def queryset(self, request, queryset):
        span = self.SPANS.get(self.value() or "")
        return queryset.filter(created_at__gte=timezone.now() - span) if span else queryset


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
        return format_html('<a href="?{}">{}</a>', urlencode({"subject": event.subject}), event.subject)

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
