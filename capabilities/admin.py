"""The owner's console for capabilities, their versions and the bindings they may declare."""

from __future__ import annotations

import difflib
from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from agents.admin import AgentAdmin as BaseAgentAdmin
from agents.models import Agent
from capabilities import bindings as binding_rules
from capabilities import selectors, services
from capabilities.models import Binding, BindingGrant, BindingKind, BreakerState, Capability, CapabilityVersion, State
from capabilities.runtimes.errors import RuntimeFailure
from sigil_site.errors import SigilError

# What an action may fail with: Sigil's API errors, and a runtime failing under it.
ACTION_ERRORS = (SigilError, RuntimeFailure)


def owner_actor(request) -> str:
    return f"owner:{request.user.get_username()}"


class ExpiredEphemeralFilter(admin.SimpleListFilter):
    title = "expiry"
    parameter_name = "expiry"

    def lookups(self, request, model_admin):
        return [("expired", "expired, not yet removed")]

    def queryset(self, request, queryset):
        if self.value() == "expired":
            return queryset.filter(expires_at__lte=timezone.now()).exclude(state=State.REMOVED)
        return queryset


class BreakerFilter(admin.SimpleListFilter):
    title = "health"
    parameter_name = "health"

    def lookups(self, request, model_admin):
        return [("degraded", "degraded (breaker open)"), ("ok", "breaker closed")]

    def queryset(self, request, queryset):
        if self.value() == "degraded":
            return queryset.filter(breaker_state=BreakerState.OPEN)
        if self.value() == "ok":
            return queryset.filter(breaker_state=BreakerState.CLOSED)
        return queryset


class PlacementFilter(admin.SimpleListFilter):
    title = "runtime placement"
    parameter_name = "placement"

    def lookups(self, request, model_admin):
        return [
            ("placed", "on the runtime (live or evicting)"),
            ("paged_out", "paged out (a call pages it in)"),
            ("no_slot", "never placed"),
        ]

    def queryset(self, request, queryset):
        if self.value() == "placed":
            return queryset.filter(state__in=(State.LIVE, State.EVICTING))
        if self.value() == "paged_out":
            return queryset.filter(state=State.PAGED_OUT)
        if self.value() == "no_slot":
            return queryset.filter(slot="")
        return queryset


class InactiveFilter(admin.SimpleListFilter):
    title = "activity"
    parameter_name = "activity"

    def lookups(self, request, model_admin):
        return [("inactive", "marked inactive"), ("active", "active")]

    def queryset(self, request, queryset):
        if self.value() == "inactive":
            return queryset.filter(inactive_at__isnull=False)
        if self.value() == "active":
            return queryset.filter(inactive_at__isnull=True)
        return queryset


def version_diff(old: CapabilityVersion | None, new: CapabilityVersion) -> list[tuple[str, str]]:
    """The unified diff from `old` to `new` as (kind, line) pairs, for the template to
    escape: kind is `add`, `del`, `hunk`, `file` or `same`."""
    before = old.code.splitlines() if old else []
    lines = difflib.unified_diff(
        before,
        new.code.splitlines(),
        fromfile=f"v{old.number}" if old else "(nothing)",
        tofile=f"v{new.number}",
        lineterm="",
    )
    kinds = {"+++": "file", "---": "file", "@@": "hunk", "+": "add", "-": "del"}
    result = []
    for line in lines:
        kind = next((k for prefix, k in kinds.items() if line.startswith(prefix)), "same")
        result.append((kind, line))
    return result


def plural(count: int) -> str:
    return f"{count} capability" if count == 1 else f"{count} capabilities"


@admin.register(Capability)
class CapabilityAdmin(admin.ModelAdmin):
    list_display = [
        "full_name",
        "agent",
        "type",
        "state",
        "slot",
        "is_public",
        "health",
        "version",
        "last_access_at",
        "calls_total",
        "errors_total",
    ]
    list_filter = [
        "state",
        "type",
        "is_public",
        BreakerFilter,
        PlacementFilter,
        ExpiredEphemeralFilter,
        InactiveFilter,
        "agent",
    ]
    list_select_related = ["agent", "current_version"]
    search_fields = ["full_name", "agent__name", "slot"]
    actions = [
        "make_public",
        "make_private",
        "reset_breakers",
        "force_degraded",
        "page_in",
        "evict",
        "remove_capabilities",
    ]
    change_form_template = "admin/capabilities/capability/change_form.html"
    fieldsets = [
        (None, {"fields": ["agent", "full_name", "type", "is_public", "declared_bindings", "current_version"]}),
        ("Runtime", {"fields": ["state", "slot", "placed_sha", "health", "breaker_opened_at"]}),
        ("Traffic, last 24 hours", {"fields": ["traffic"]}),
        (
            "Since it was created",
            {"fields": ["calls_total", "errors_total", "cold_calls_total", "last_access_at", "inactive_at"]},
        ),
        ("Dates", {"fields": ["created_at", "updated_at", "expires_at", "removed_at"]}),
        ("Versions", {"fields": ["versions_panel"]}),
    ]
    readonly_fields = [
        "agent",
        "full_name",
        "type",
        "is_public",
        "declared_bindings",
        "current_version",
        "state",
        "slot",
        "placed_sha",
        "health",
        "breaker_opened_at",
        "traffic",
        "calls_total",
        "errors_total",
        "cold_calls_total",
        "last_access_at",
        "inactive_at",
        "created_at",
        "updated_at",
        "expires_at",
        "removed_at",
        "versions_panel",
    ]

    @admin.display(description="breaker", ordering="breaker_state")
    def health(self, capability: Capability) -> str:
        if capability.breaker_state == BreakerState.OPEN:
            return mark_safe('<strong class="degraded-state" style="color: var(--error-fg)">degraded</strong>')
        return "ok"

    @admin.display(description="version", ordering="current_version__number")
    def version(self, capability: Capability) -> str:
        return f"v{capability.current_version.number}" if capability.current_version else "–"

    @admin.display(description="bindings")
    def declared_bindings(self, capability: Capability) -> str:
        if not capability.bindings:
            return "none declared"
        offered = {str(b): b for b in Binding.objects.all()}
        granted = set(BindingGrant.objects.filter(agent_id=capability.agent_id).values_list("binding_id", flat=True))
        items = []
        for declaration in capability.bindings:
            binding = offered.get(declaration)
            if binding is None:
                items.append(format_html("<li><code>{}</code>: not offered</li>", declaration))
            elif binding.pk not in granted:
                url = reverse("admin:capabilities_binding_change", args=[binding.pk])
                items.append(
                    format_html(
                        '<li><a href="{}"><code>{}</code></a>: not granted to {}, left out</li>',
                        url,
                        declaration,
                        capability.agent.name,
                    )
                )
            else:
                url = reverse("admin:capabilities_binding_change", args=[binding.pk])
                items.append(
                    format_html(
                        '<li><a href="{}"><code>{}</code></a> {}</li>',
                        url,
                        declaration,
                        binding.get_kind_display(),
                    )
                )
        return format_html('<ul class="bindings">{}</ul>', format_html_join("", "{}", ((i,) for i in items)))

    @admin.display(description="calls")
    def traffic(self, capability: Capability) -> str:
        report = selectors.capability_stats(capability=capability, since=timezone.now() - timedelta(hours=24))
        if not report["calls"]:
            return "no calls flushed in the last 24 hours"

        def ms(value):
            return "–" if value is None else f"{value:.1f} ms"

        return format_html(
            "{} calls, {} errors ({}), {} cold; p50 {}, p95 {}; mean page-in {}",
            report["calls"],
            report["errors"],
            f"{100 * report['error_rate']:.1f} %",
            report["cold_calls"],
            ms(report["p50_ms"]),
            ms(report["p95_ms"]),
            ms(report["mean_page_in_ms"]),
        )

    @admin.display(description="all versions")
    def versions_panel(self, capability: Capability) -> str:
        rows = []
        can_roll_back = capability.state != State.REMOVED
        for version in capability.versions.order_by("-number"):
            current = version.pk == capability.current_version_id
            view = reverse("admin:capabilities_capability_version", args=[capability.pk, version.number])
            if current:
                action = mark_safe("<strong>current</strong>")
            elif can_roll_back:
                action = format_html(
                    '<button type="submit" class="button" form="rollback-form" name="version" value="{}" '
                    'id="rollback-v{}">Roll back to v{}</button>',
                    version.number,
                    version.number,
                    version.number,
                )
            else:
                action = ""
            rows.append(
                format_html(
                    '<tr><td>v{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td><a href="{}">code and diff</a>'
                    "</td><td>{}</td></tr>",
                    version.number,
                    version.sha[:12],
                    version.size_bytes,
                    version.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                    view,
                    action,
                )
            )
        return format_html(
            '<table id="versions"><thead><tr><th>version</th><th>sha256</th><th>bytes</th><th>deployed</th>'
            "<th></th><th></th></tr></thead><tbody>{}</tbody></table>",
            format_html_join("", "{}", ((row,) for row in rows)),
        )

    def has_add_permission(self, request) -> bool:
        return False  # capabilities are deployed by agents over the API

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # "remove" keeps the versions and the trail

    def change_view(self, request, object_id, form_url="", extra_context=None):
        # Every field is read-only: the page changes things through its buttons and actions.
        extra_context = {
            **(extra_context or {}),
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
        }
        return super().change_view(request, object_id, form_url, extra_context)

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path(
                "<path:object_id>/versions/<int:number>/",
                view(self.version_view),
                name="capabilities_capability_version",
            ),
            path("<path:object_id>/rollback/", view(self.rollback_view), name="capabilities_capability_rollback"),
            *super().get_urls(),
        ]

    def version_view(self, request, object_id, number):
        """One version's code, and its differences from another version (the one before it
        unless `?against=N`)."""
        capability = get_object_or_404(Capability.objects.select_related("agent"), pk=object_id)
        if not self.has_view_permission(request, capability):
            raise PermissionDenied
        versions = {v.number: v for v in capability.versions.all()}
        if number not in versions:
            raise Http404(f"{capability.full_name} has no version {number}")
        version = versions[number]
        try:
            against_number = int(request.GET.get("against", number - 1))
        except ValueError:
            against_number = number - 1
        against = versions.get(against_number)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"{capability.full_name} v{number}",
            "capability": capability,
            "version": version,
            "against": against,
            "others": [n for n in sorted(versions) if n != number],
            "diff": version_diff(against, version) if against else [],
            "is_current": version.pk == capability.current_version_id,
            "can_roll_back": capability.state != State.REMOVED and self.has_change_permission(request, capability),
        }
        return TemplateResponse(request, "admin/capabilities/capability/version.html", context)

    def rollback_view(self, request, object_id):
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        capability = get_object_or_404(Capability.objects.select_related("agent"), pk=object_id)
        if not self.has_change_permission(request, capability):
            raise PermissionDenied
        change_url = reverse("admin:capabilities_capability_change", args=[capability.pk])
        try:
            number = int(request.POST.get("version", ""))
        except ValueError:
            self.message_user(request, "Choose a version to roll back to.", level=messages.ERROR)
            return HttpResponseRedirect(change_url)
        try:
            result = services.capability_rollback(
                capability=capability, version_number=number, actor=owner_actor(request)
            )
        except ACTION_ERRORS as exc:
            message = getattr(exc, "message", None) or str(exc)
            self.message_user(request, f"{capability.full_name}: {message}", level=messages.ERROR)
            return HttpResponseRedirect(change_url)
        if result.version.number == number:
            self.message_user(request, f"{capability.full_name} already serves v{number}.", level=messages.WARNING)
        else:
            self.message_user(
                request, f"Rolled {capability.full_name} back to the code of v{number}, now v{result.version.number}."
            )
        return HttpResponseRedirect(change_url)

    def _each(self, request, queryset, done: str, call) -> None:
        """Run one service per capability; count those it changed, report each failure."""
        changed = 0
        for capability in queryset.select_related("agent").exclude(state=State.REMOVED):
            try:
                result = call(capability)
            except ACTION_ERRORS as exc:
                message = getattr(exc, "message", None) or str(exc)
                self.message_user(request, f"{capability.full_name}: {message}", level=messages.ERROR)
                continue
            changed += result is None or bool(result)
        self.message_user(request, done.format(plural(changed)))

    @admin.action(description="Make selected capabilities public")
    def make_public(self, request, queryset) -> None:
        actor = owner_actor(request)
        self._each(
            request,
            queryset,
            "Made {} public.",
            lambda c: services.capability_set_public(capability=c, is_public=True, actor=actor),
        )

    @admin.action(description="Make selected capabilities private")
    def make_private(self, request, queryset) -> None:
        actor = owner_actor(request)
        self._each(
            request,
            queryset,
            "Made {} private.",
            lambda c: services.capability_set_public(capability=c, is_public=False, actor=actor),
        )

    @admin.action(description="Reset the circuit breaker of selected capabilities")
    def reset_breakers(self, request, queryset) -> None:
        actor = owner_actor(request)
        self._each(
            request,
            queryset,
            "Reset the breaker of {}.",
            lambda c: services.capability_reset_breaker(capability=c, actor=actor),
        )

    @admin.action(description="Force selected capabilities degraded (503 until reset)")
    def force_degraded(self, request, queryset) -> None:
        actor = owner_actor(request)
        self._each(
            request,
            queryset,
            "Forced {} degraded; reset the breaker to serve again.",
            lambda c: services.capability_force_degraded(capability=c, actor=actor),
        )

    @admin.action(description="Page in selected capabilities (place them on the runtime)")
    def page_in(self, request, queryset) -> None:
        self._each(
            request,
            queryset,
            "Paged in {}.",
            lambda c: services.capability_page_in(full=c.full_name, reason=owner_actor(request))[1],
        )

    @admin.action(description="Evict selected capabilities (page them out)")
    def evict(self, request, queryset) -> None:
        actor = owner_actor(request)
        self._each(request, queryset, "Evicted {}.", lambda c: services.capability_evict(full=c.full_name, actor=actor))

    @admin.action(description="Remove selected capabilities")
    def remove_capabilities(self, request, queryset) -> None:
        actor = owner_actor(request)
        self._each(
            request,
            queryset,
            "Removed {}.",
            lambda c: services.capability_remove_as_owner(full=c.full_name, actor=actor),
        )


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
        elif kind and name:
            try:
                services.binding_check_rename(self.instance, kind=kind, name=name)
            except SigilError as exc:
                self.add_error("name", exc.message)
        if kind == BindingKind.SECRET:
            has_stored = bool(self.instance.secret_encrypted)
            if not (data.get("secret_env") or data.get("secret_value") or has_stored):
                self.add_error("secret_value", "a secret needs a value or an environment variable")
        elif not data.get("value"):
            self.add_error("value", "this kind needs a value (a resource id, a name or the text)")
        return data


class GrantForm(forms.ModelForm):
    """One grant in an inline: a new one names its binding or agent; an existing one is
    only revoked (deleted), never repointed, so that each change is one audited service call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            for field in self.fields.values():
                field.disabled = True


class GrantInline(admin.TabularInline):
    model = BindingGrant
    form = GrantForm
    extra = 0
    readonly_fields = ["granted_at"]
    verbose_name = "grant"
    verbose_name_plural = "granted to these agents"


class AgentGrantInline(GrantInline):
    fields = ["binding", "granted_at"]
    verbose_name_plural = "bindings granted (the only ones its capabilities may declare)"


class BindingGrantInline(GrantInline):
    fields = ["agent", "granted_at"]
    verbose_name_plural = "granted to these agents (the only ones whose capabilities may declare it)"


class GrantsSavedByServices:
    """Saves the grant inline through `binding_grant` and `binding_revoke` (audit, and placing
    the agent's live capabilities again), never with the formset's own save."""

    def save_formset(self, request, form, formset, change) -> None:
        if formset.model is not BindingGrant:
            super().save_formset(request, form, formset, change)
            return
        actor = owner_actor(request)
        refreshing = []
        # What formset.save() would have set, for the admin's history message.
        formset.new_objects, formset.changed_objects, formset.deleted_objects = [], [], []
        for row in formset.deleted_forms:
            if row.instance.pk is not None:
                grant = row.instance
                refreshing += services.binding_revoke(binding=grant.binding, agent=grant.agent, actor=actor)
                formset.deleted_objects.append(grant)
        for row in formset.forms:
            if row in formset.deleted_forms or row.instance.pk is not None or not row.has_changed():
                continue
            grant = row.instance
            setattr(grant, formset.fk.name, formset.instance)  # saved only now, on an add page
            refreshing += services.binding_grant(binding=grant.binding, agent=grant.agent, actor=actor)
            formset.new_objects.append(grant)
        if refreshing:
            self.message_user(request, f"Placing again with the grants changed: {', '.join(refreshing)}.")


admin.site.unregister(Agent)


@admin.register(Agent)
class AgentAdmin(GrantsSavedByServices, BaseAgentAdmin):
    """The agents' admin, with the bindings granted to each (kept here: agents never imports
    capabilities)."""

    inlines = [*BaseAgentAdmin.inlines, AgentGrantInline]


@admin.register(Binding)
class BindingAdmin(GrantsSavedByServices, admin.ModelAdmin):
    form = BindingForm
    list_display = ["__str__", "kind", "granted_to", "description", "updated_at"]
    list_filter = ["kind"]
    search_fields = ["name", "description"]
    readonly_fields = ["declared_by"]
    inlines = [BindingGrantInline]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("grants__agent")

    @admin.display(description="granted to")
    def granted_to(self, obj: Binding) -> str:
        return ", ".join(grant.agent.name for grant in obj.grants.all()) or "no agent"

    @admin.display(description="declared by")
    def declared_by(self, obj: Binding) -> str:
        if obj.pk is None:
            return "-"
        return ", ".join(c.full_name for c in selectors.binding_declared_by(obj.kind, obj.name)) or "no capability"

    def save_model(self, request, obj, form, change) -> None:
        refreshing = services.binding_save(
            binding=obj, secret_value=form.cleaned_data.get("secret_value", ""), actor=owner_actor(request)
        )
        if refreshing:
            self.message_user(request, f"Placing again with the new value: {', '.join(refreshing)}.")

    def get_deleted_objects(self, objs, request):
        # Capabilities declaring a binding protect it: the confirmation page names them and
        # offers no way to go on (for one binding or a selection).
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        declaring = [
            f"{b}, declared by {c.full_name}" for b in objs for c in selectors.binding_declared_by(b.kind, b.name)
        ]
        return deleted, counts, perms_needed, [*protected, *declaring]

    def delete_model(self, request, obj) -> None:
        services.binding_delete(binding=obj, actor=owner_actor(request))

    def delete_queryset(self, request, queryset) -> None:
        for binding in queryset:
            try:
                services.binding_delete(binding=binding, actor=owner_actor(request))
            except SigilError as exc:
                self.message_user(request, exc.message, level=messages.ERROR)
