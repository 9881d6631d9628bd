"""The owner's console for capabilities and their versions."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.utils import timezone

from agents.services import audit_record
from capabilities import bindings as binding_rules
from capabilities import services
from capabilities.models import Binding, BindingKind, Capability, CapabilityVersion, State
from sigil_site.errors import SigilError


class VersionInline(admin.TabularInline):
    model = CapabilityVersion
    extra = 0
    can_delete = False
    fields = ["number", "sha", "size_bytes", "created_at"]
    readonly_fields = fields
    ordering = ["-number"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


class ExpiredEphemeralFilter(admin.SimpleListFilter):
    title = "expiry"
    parameter_name = "expiry"

    def lookups(self, request, model_admin):
        return [("expired", "expired, not yet removed")]

    def queryset(self, request, queryset):
        if self.value() == "expired":
            return queryset.filter(expires_at__lte=timezone.now()).exclude(state=State.REMOVED)
        return queryset


@admin.register(Capability)
class CapabilityAdmin(admin.ModelAdmin):
    list_display = [
        "full_name",
        "type",
        "state",
        "is_public",
        "breaker_state",
        "last_access_at",
        "calls_total",
        "errors_total",
    ]
    list_filter = ["state", "type", "is_public", "breaker_state", ExpiredEphemeralFilter, "agent"]
    list_select_related = ["agent", "current_version"]
    search_fields = ["full_name", "agent__name"]
    readonly_fields = [
        "agent",
        "name",
        "full_name",
        "type",
        "is_public",
        "bindings",
        "state",
        "slot",
        "placed_sha",
        "current_version",
        "created_at",
        "updated_at",
        "expires_at",
        "removed_at",
        "last_access_at",
        "calls_total",
        "errors_total",
        "latency_ms_total",
        "breaker_state",
        "breaker_opened_at",
    ]
    inlines = [VersionInline]
    actions = ["remove_capabilities", "reset_breakers"]

    def has_add_permission(self, request) -> bool:
        return False  # capabilities are deployed by agents over the API

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # "remove" keeps the versions and the trail

    @admin.action(description="Remove selected capabilities")
    def remove_capabilities(self, request, queryset) -> None:
        removed = 0
        for capability in queryset.exclude(state=State.REMOVED):
            try:
                services.capability_remove_as_owner(full=capability.full_name, actor=f"owner:{request.user.username}")
                removed += 1
            except SigilError as exc:
                self.message_user(request, f"{capability.full_name}: {exc.message}", level=messages.ERROR)
        self.message_user(request, f"Removed {removed} capabilities.")

    @admin.action(description="Reset the circuit breaker of selected capabilities")
    def reset_breakers(self, request, queryset) -> None:
        for capability in queryset.select_related("agent"):
            services.capability_reset_breaker(capability=capability, actor=f"owner:{request.user.username}")
        self.message_user(request, f"Reset the breaker of {queryset.count()} capabilities.")


class BindingForm(forms.ModelForm):
    secret_value = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="For SECRET: the secret itself, stored encrypted and never shown again. "
        "Leave empty to keep the stored one, or use the environment variable field instead.",
    )

    class Meta:
        model = Binding
        fields = ["kind", "name", "value", "secret_env", "secret_value", "description"]

    def clean(self):
        data = super().clean()
        kind, name = data.get("kind"), data.get("name")
        if name and not binding_rules.DECLARATION.fullmatch(f"{kind}:{name}"):
            self.add_error("name", "upper case letters, digits and _, starting with a letter")
        if kind == BindingKind.SECRET:
            has_stored = bool(self.instance.secret_encrypted)
            if not (data.get("secret_env") or data.get("secret_value") or has_stored):
                self.add_error("secret_value", "a secret needs a value or an environment variable")
        elif not data.get("value"):
            self.add_error("value", "this kind needs a value (a resource id, a name or the text)")
        return data


@admin.register(Binding)
class BindingAdmin(admin.ModelAdmin):
    form = BindingForm
    list_display = ["__str__", "kind", "description", "updated_at"]
    list_filter = ["kind"]
    search_fields = ["name", "description"]

    def save_model(self, request, obj, form, change) -> None:
        secret = form.cleaned_data.get("secret_value")
        if secret:
            obj.secret_encrypted = binding_rules.secret_encrypt(secret)
            obj.secret_env = ""
        obj.updated_at = timezone.now()
        super().save_model(request, obj, form, change)
        audit_record(
            actor=f"owner:{request.user.username}",
            action="binding.changed" if change else "binding.created",
            subject=str(obj),
        )
