"""The owner's console for agents, tokens and the audit trail."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.utils import timezone

from agents import services
from agents.models import Agent, AuditEvent, Token


class TokenInline(admin.TabularInline):
    model = Token
    extra = 0
    can_delete = False
    fields = ["prefix", "scope", "label", "created_at", "expires_at", "revoked_at", "last_used_at"]
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = ["name", "is_active", "created_at"]
    list_filter = ["is_active"]
    search_fields = ["name"]
    readonly_fields = ["created_at"]
    inlines = [TokenInline]
    actions = ["disable_agents", "enable_agents"]

    def get_readonly_fields(self, request, obj=None):
        # The name is the capabilities' prefix: fixed once the agent exists.
        return ["name", "is_active", "created_at"] if obj else ["created_at"]

    def get_fields(self, request, obj=None):
        return ["name", "is_active", "created_at"] if obj else ["name"]

    def save_model(self, request, obj, form, change) -> None:
        if not change:
            created = services.agent_create(name=obj.name, actor=f"owner:{request.user.username}")
            obj.pk = created.pk
            obj.created_at = created.created_at

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # capabilities and the audit trail refer to agents; disable instead

    @admin.action(description="Disable selected agents (their tokens stop at once)")
    def disable_agents(self, request, queryset) -> None:
        count = sum(
            services.agent_set_active(agent=a, is_active=False, actor=f"owner:{request.user.username}")
            for a in queryset
        )
        self.message_user(request, f"Disabled {count} agent(s).")

    @admin.action(description="Enable selected agents")
    def enable_agents(self, request, queryset) -> None:
        count = sum(
            services.agent_set_active(agent=a, is_active=True, actor=f"owner:{request.user.username}") for a in queryset
        )
        self.message_user(request, f"Enabled {count} agent(s).")


class TokenCreationForm(forms.ModelForm):
    class Meta:
        model = Token
        fields = ["agent", "scope", "label", "expires_at"]


class TokenStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [("usable", "usable"), ("revoked", "revoked"), ("expired", "expired")]

    def queryset(self, request, queryset):
        now = timezone.now()
        if self.value() == "usable":
            return queryset.filter(revoked_at__isnull=True).exclude(expires_at__lte=now)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        if self.value() == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        return queryset


@admin.register(Token)
class TokenAdmin(admin.ModelAdmin):
    list_display = ["prefix", "agent", "scope", "label", "created_at", "expires_at", "revoked_at", "last_used_at"]
    list_filter = [TokenStateFilter, "scope", "agent"]
    list_select_related = ["agent"]
    search_fields = ["prefix", "label", "agent__name"]
    readonly_fields = ["agent", "scope", "label", "prefix", "created_at", "expires_at", "revoked_at", "last_used_at"]
    actions = ["revoke_tokens"]

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
            actor=f"owner:{request.user.username}",
        )
        obj.pk = token.pk
        messages.warning(
            request,
            f"Token for {token.agent.name} ({token.scope}): {secret} — copy it now, it is not shown again.",
        )

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # revoke instead, so the trail keeps the token's prefix

    @admin.action(description="Revoke selected tokens")
    def revoke_tokens(self, request, queryset) -> None:
        count = sum(services.token_revoke(token=t, actor=f"owner:{request.user.username}") for t in queryset)
        self.message_user(request, f"Revoked {count} token(s).")


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "actor", "action", "agent_name", "subject"]
    list_filter = ["action", "agent_name"]
    search_fields = ["subject", "actor", "agent_name"]
    date_hierarchy = "created_at"
    readonly_fields = ["created_at", "actor", "action", "agent_name", "subject", "detail"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
