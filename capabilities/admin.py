"""The owner's console for capabilities, their versions and the bindings they may declare."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django import forms
from django.conf import settings
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
from agents.admin import RefusalsAsMessages, SelectionChecked
from agents.models import Agent
from capabilities import bindings as binding_rules
from capabilities import breaker, call_logs, failures, selectors, services
from capabilities.api import capability_url
from capabilities.contracts import Contract
from capabilities.dashboard import dashboard_get
from capabilities.models import (
    Binding,
    BindingGrant,
    BindingKind,
    BreakerState,
    Capability,
    CapabilityVersion,
    State,
    VersionPlacement,
)
from capabilities.runtimes.errors import RuntimeFailure
from sigil import charts
from sigil.errors import SigilError

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


def contract_text(version: CapabilityVersion | None) -> str:
    """A version's contract as text, one field after the other, schemas as indented JSON: what
    the capability page shows and the version view diffs. Empty when it declares none."""
    parts = []
    for name, value in Contract.of(version).as_fields().items():
        if value:
            shown = value if isinstance(value, str) else json.dumps(value, indent=2, sort_keys=True)
            parts.append(f"{name}:\n{shown}")
    return "\n\n".join(parts)


def version_diff(
    old: CapabilityVersion | None, new: CapabilityVersion, text=lambda version: version.code
) -> list[tuple[str, str]]:
    """The unified diff from `old` to `new` (their code, or another `text` of them) as (kind,
    line) pairs, for the template to escape: kind is `add`, `del`, `hunk`, `file` or `same`."""
    before = text(old).splitlines() if old else []
    lines = difflib.unified_diff(
        before,
        text(new).splitlines(),
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


@dataclass(frozen=True)
class PageAction:
    """A button on a capability's page: the service it calls, and for a destructive one,
    what the confirmation page says will happen."""

    slug: str
    label: str
    run: Callable[[Capability, str], object]  # (capability, actor) → the service's result
    done: str  # "{}" is the capability's name
    applies: Callable[[Capability, breaker.BreakerReport], bool]
    confirm: str = ""  # empty: no confirmation page


PAGE_ACTIONS = [
    PageAction(
        "reset-breaker",
        "Reset the breaker",
        lambda c, actor: services.capability_reset_breaker(capability=c, actor=actor),
        "Reset the breaker of {}: calls go through again.",
        lambda c, b: b.status != breaker.Status.CLOSED or c.breaker_state == BreakerState.OPEN,
    ),
    PageAction(
        "force-degraded",
        "Force degraded",
        lambda c, actor: services.capability_force_degraded(capability=c, actor=actor),
        "Forced {} degraded; reset the breaker to serve again.",
        lambda c, b: b.status != breaker.Status.FORCED,
        confirm="Every call will be answered 503 degraded, without running the code, until the breaker is reset.",
    ),
    PageAction(
        "page-in",
        "Page in",
        lambda c, actor: services.capability_page_in(full=c.full_name, reason=actor)[1],
        "Paged in {}.",
        lambda c, b: c.state in (State.PAGED_OUT, State.FAILED),
    ),
    PageAction(
        "evict",
        "Evict",
        lambda c, actor: services.capability_evict(full=c.full_name, actor=actor),
        "Evicted {}; its next call pages it back in.",
        lambda c, b: c.state == State.LIVE,
        confirm="Its script will be deleted from the runtime; the next call pages it back in (a cold start).",
    ),
    PageAction(
        "make-public",
        "Make public",
        lambda c, actor: services.capability_set_public(capability=c, is_public=True, actor=actor),
        "Made {} public.",
        lambda c, b: not c.is_public,
        confirm="Every agent may find and call it from the next request on, with its own invoke token; "
        "calls by other agents count in its traffic.",
    ),
    PageAction(
        "make-private",
        "Make private",
        lambda c, actor: services.capability_set_public(capability=c, is_public=False, actor=actor),
        "Made {} private.",
        lambda c, b: c.is_public,
        confirm="Other agents' calls to it are answered 404 from the next request on; only its own agent may call it.",
    ),
    PageAction(
        "remove",
        "Remove",
        lambda c, actor: services.capability_remove_as_owner(full=c.full_name, actor=actor),
        "Removed {}.",
        lambda c, b: True,
        confirm="It stops serving at once and its script is deleted; its versions and audit trail stay.",
    ),
]
PAGE_ACTIONS_BY_SLUG = {action.slug: action for action in PAGE_ACTIONS}


def epoch_time(epoch: float | None) -> datetime | None:
    return None if epoch is None else timezone.localtime(datetime.fromtimestamp(epoch, tz=UTC))


@admin.register(Capability)
class CapabilityAdmin(SelectionChecked, admin.ModelAdmin):
    list_display = [
        "full_name",
        "agent",
        "type",
        "state",
        "visibility",
        "health",
        "version",
        "last_call",
        "calls",
        "errors",
        "refused",
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
    search_fields = ["full_name", "agent__name", "slot", "current_version__description"]
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
        (None, {"fields": ["agent", "full_name", "type", "visibility", "declared_bindings", "current_version"]}),
        ("Runtime", {"fields": ["runtime", "state", "slot", "placed_bundle", "health", "breaker_opened_at"]}),
        (
            "Since it was created",
            {"fields": ["calls_total", "errors_total", "cold_calls_total", "last_access_at", "inactive_at"]},
        ),
        ("Dates", {"fields": ["created_at", "updated_at", "expires_at", "removed_at"]}),
        ("Versions", {"fields": ["versions_panel"]}),
        ("Traffic split", {"fields": ["split_panel"]}),
    ]
    readonly_fields = [
        "agent",
        "full_name",
        "type",
        "visibility",
        "declared_bindings",
        "current_version",
        "runtime",
        "state",
        "slot",
        "placed_bundle",
        "health",
        "breaker_opened_at",
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
        "split_panel",
    ]

    @admin.display(description="breaker", ordering="breaker_state")
    def health(self, capability: Capability) -> str:
        if capability.breaker_state == BreakerState.OPEN:
            return mark_safe('<strong class="degraded-state" style="color: var(--error-fg)">degraded</strong>')
        return "ok"

    @admin.display(description="runtime")
    def runtime(self, capability: Capability) -> str:
        """Which runtime holds it, and a warning when that is not SIGIL_BACKEND's: the
        gateway serves it there until a switch moves it, if that runtime still answers."""
        configured = settings.SIGIL_BACKEND
        if capability.state not in (State.LIVE, State.EVICTING):
            return format_html('<span id="runtime">none</span> (not placed; its next placement is on {})', configured)
        backend = capability.backend or configured
        if backend == configured:
            return format_html('<span id="runtime">{}</span>', backend)
        failure = services.runtime_failure(backend)
        served = (
            format_html("{} does not answer ({}): its calls fail", backend, failure)
            if failure
            else format_html("it is served from {}", backend)
        )
        return format_html(
            '<span id="runtime">{}</span> <strong id="runtime-warning" style="color: var(--error-fg)">not '
            "SIGIL_BACKEND ({}): {} until <code>python manage.py switchbackend</code> moves it</strong>",
            backend,
            configured,
            served,
        )

    @admin.display(description="placed bundle sha256")
    def placed_bundle(self, capability: Capability) -> str:
        # Not the version's code sha: the bundle also covers the bindings' values.
        if not capability.placed_sha:
            return "– (nothing placed)"
        return format_html(
            '<code>{}</code><div class="help">The sha256 of what the runtime holds: the code with the values of its '
            "bindings, so it differs from the version's code sha, and changes when a binding's value does.</div>",
            capability.placed_sha,
        )

    @admin.display(description="visibility", ordering="is_public")
    def visibility(self, capability: Capability) -> str:
        # Words, not the admin's ✓/✗ icons: a private capability is no error.
        return "public" if capability.is_public else "private"

    # Short headings, so that the list fits 1400 px beside the filters.
    @admin.display(description="last call", ordering="last_access_at")
    def last_call(self, capability: Capability):
        return capability.last_access_at

    @admin.display(description="calls", ordering="calls_total")
    def calls(self, capability: Capability) -> int:
        return capability.calls_total

    @admin.display(description="errors", ordering="errors_total")
    def errors(self, capability: Capability) -> int:
        return capability.errors_total

    @admin.display(description="refused", ordering="refused_total")
    def refused(self, capability: Capability) -> int:
        return capability.refused_total

    def changelist_view(self, request, extra_context=None):
        return super().changelist_view(request, {"title": "Capabilities", **(extra_context or {})})

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

    @admin.display(description="all versions")
    def versions_panel(self, capability: Capability) -> str:
        rows = []
        can_roll_back = capability.state != State.REMOVED
        never_served = selectors.capability_versions_never_served(capability=capability)
        for version in capability.versions.order_by("-number"):
            current = version.pk == capability.current_version_id
            view = reverse("admin:capabilities_capability_version", args=[capability.pk, version.number])
            if current:
                action = mark_safe("<strong>current</strong>")
            elif version.pk == capability.staged_version_id:
                action = mark_safe('<em class="staged">staged: promote or abort it below</em>')
            elif version.number in never_served:
                # Rolling back to it would serve code that never passed a split's guard.
                action = mark_safe('<em class="never-served">staged once, never served</em>')
            elif version.placement == VersionPlacement.PLACING:
                action = mark_safe('<em class="placing">being placed…</em>')
            elif version.placement == VersionPlacement.FAILED:
                failure = version.failure or {}
                action = format_html(
                    '<span class="failed" style="color: var(--error-fg)">not placed: {}</span>',
                    failure.get("message") or failure.get("code") or "refused",
                )
            elif can_roll_back:
                action = format_html(
                    '<a class="button" href="{}?version={}" id="rollback-v{}">Roll back to v{}…</a>',
                    reverse("admin:capabilities_capability_rollback", args=[capability.pk]),
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
            '<div class="sigil-wide"><table id="versions"><thead><tr><th>version</th><th>sha256</th><th>bytes</th>'
            "<th>deployed</th>"
            "<th></th><th></th></tr></thead><tbody>{}</tbody></table></div>",
            format_html_join("", "{}", ((row,) for row in rows)),
        )

    @admin.display(description="versions in traffic")
    def split_panel(self, capability: Capability) -> str:
        return split_panel(capability)

    def get_queryset(self, request):
        # A staged version in traffic is shown on its capability's page, not as one of its own.
        return super().get_queryset(request).filter(variant_of__isnull=True)

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
        capability = Capability.objects.select_related("agent", "current_version").filter(pk=object_id).first()
        if capability is not None:
            extra_context.update(self.page_context(request, capability))
        return super().change_view(request, object_id, form_url, extra_context)

    def page_context(self, request, capability: Capability) -> dict:
        """What the capability's page shows above its details: how to call it, its breaker and
        why, the last 24 hours, its recent failures, its code, and the actions that apply."""
        report = breaker.breaker_describe(full=capability.full_name)
        removed = capability.state == State.REMOVED
        can_change = self.has_change_permission(request, capability)
        now = timezone.now()
        day = dashboard_get(now=now, span=timedelta(hours=24), step=timedelta(minutes=30), full=capability.full_name)
        labels = [timezone.localtime(bucket.start).strftime("%H:%M") for bucket in day.buckets]
        chart = charts.time_chart(
            title="Answers, last 24 hours",
            x_labels=labels,
            kind="bars",
            series=[
                charts.Series("calls", [b.calls for b in day.buckets], "calls"),
                charts.Series("errors", [b.errors for b in day.buckets], "errors"),
                charts.Series("refused", [b.refused for b in day.buckets], "refused"),
            ],
        )
        return {
            "title": f"Capability {capability.full_name}",
            "subtitle": None,
            "call_url": capability_url(request, capability),
            "contract": contract_text(capability.current_version),
            "breaker_report": report,
            "breaker_opened_at": epoch_time(report.opened_at_epoch),
            "breaker_until": epoch_time(report.until_epoch),
            "breaker_forced_at": epoch_time(report.forced_at_epoch),
            "tripped_ids": {f.request_id for f in report.tripped_by},
            "failures": [(f, epoch_time(f.at_epoch)) for f in failures.failures_list(full=capability.full_name)],
            "failures_kept": settings.SIGIL_FAILURES_KEPT,
            **self.call_records_context(request, capability),
            "day": day,
            "day_chart": chart,
            "statuses": sorted(day.total.statuses.items()),
            "codes": sorted(day.total.codes.items()),
            "page_actions": []
            if removed or not can_change
            else [a for a in PAGE_ACTIONS if a.applies(capability, report)],
        }

    def call_records_context(self, request, capability: Capability) -> dict:
        """The page's call records panel: the latest, filtered by `logs_level` and `logs_request`."""
        level = request.GET.get("logs_level") or None
        level = level if level in call_logs.LEVELS else None
        request_id = (request.GET.get("logs_request") or "").strip()[:64] or None
        page = call_logs.call_records_list(full=capability.full_name, level=level, request_id=request_id, limit=20)
        return {
            "call_records": [(r, epoch_time(r["at"])) for r in page.records],
            "call_records_level": level or "",
            "call_records_request": request_id or "",
            "call_records_levels": call_logs.LEVELS,
            "call_records_lost": call_logs.call_records_lost(full=capability.full_name),
            "call_records_kept": settings.SIGIL_LOGS_RECORDS_PER_CAPABILITY,
        }

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path(
                "<path:object_id>/versions/<int:number>/",
                view(self.version_view),
                name="capabilities_capability_version",
            ),
            path("<path:object_id>/rollback/", view(self.rollback_view), name="capabilities_capability_rollback"),
            path(
                "<path:object_id>/actions/<slug:slug>/",
                view(self.action_view),
                name="capabilities_capability_action",
            ),
            path(
                "<path:object_id>/split/<str:action>/",
                view(self.split_view),
                name="capabilities_capability_split",
            ),
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
            "contract": contract_text(version),
            "contract_diff": version_diff(against, version, contract_text) if against else [],
            "is_current": version.pk == capability.current_version_id,
            "can_roll_back": capability.state != State.REMOVED
            and self.has_change_permission(request, capability)
            and version.pk != capability.staged_version_id
            and number not in selectors.capability_versions_never_served(capability=capability),
        }
        return TemplateResponse(request, "admin/capabilities/capability/version.html", context)

    def confirmation(
        self, request, capability: Capability, *, action: str, what: str, fields: dict
    ) -> TemplateResponse:
        """The page that asks before a destructive action; its form posts back to the same URL."""
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"{action}: are you sure?",
            "subject": capability.full_name,
            "subject_url": reverse("admin:capabilities_capability_change", args=[capability.page_id]),
            "changelist_url": reverse("admin:capabilities_capability_changelist"),
            "action": action,
            "what": what,
            "fields": fields,
        }
        return TemplateResponse(request, "admin/sigil/confirm.html", context)

    def action_view(self, request, object_id, slug):
        """One of PAGE_ACTIONS on one capability: asked first when destructive (GET shows the
        confirmation page), done on POST, written to the admin's history and, by the
        service, to the audit trail."""
        action = PAGE_ACTIONS_BY_SLUG.get(slug)
        if action is None:
            raise Http404(f"no action {slug}")
        capability = get_object_or_404(Capability.objects.select_related("agent"), pk=object_id)
        if not self.has_change_permission(request, capability):
            raise PermissionDenied
        change_url = reverse("admin:capabilities_capability_change", args=[capability.page_id])
        if request.method == "GET":
            what = action.confirm or f"{action.label}: {action.done.format(capability.full_name)}"
            return self.confirmation(request, capability, action=action.label, what=what, fields={})
        if request.method != "POST":
            return HttpResponseNotAllowed(["GET", "POST"])
        try:
            action.run(capability, owner_actor(request))
        except ACTION_ERRORS as exc:
            message = getattr(exc, "message", None) or str(exc)
            self.message_user(request, f"{capability.full_name}: {message}", level=messages.ERROR)
            return HttpResponseRedirect(change_url)
        self.log_change(request, capability, action.label)
        self.message_user(request, action.done.format(capability.full_name))
        if slug == "remove":
            return HttpResponseRedirect(reverse("admin:capabilities_capability_changelist"))
        return HttpResponseRedirect(change_url)

    def rollback_view(self, request, object_id):
        """Roll back to `version`: GET asks (the confirmation page), POST does it."""
        if request.method not in ("GET", "POST"):
            return HttpResponseNotAllowed(["GET", "POST"])
        capability = get_object_or_404(Capability.objects.select_related("agent", "current_version"), pk=object_id)
        if not self.has_change_permission(request, capability):
            raise PermissionDenied
        change_url = reverse("admin:capabilities_capability_change", args=[capability.pk])
        try:
            number = int(request.POST.get("version", request.GET.get("version", "")))
        except ValueError:
            self.message_user(request, "Choose a version to roll back to.", level=messages.ERROR)
            return HttpResponseRedirect(change_url)
        if request.method == "GET":
            current = capability.current_version.number if capability.current_version else None
            what = (
                f"The code of v{number} is deployed again as a new version, through the same placement as a "
                f"deploy, and served instead of v{current}'s. Bindings and the public flag stay as they are."
            )
            return self.confirmation(
                request, capability, action=f"Roll back to v{number}", what=what, fields={"version": number}
            )
        serving = capability.current_version_id
        try:
            result = services.capability_rollback(
                capability=capability, version_number=number, actor=owner_actor(request)
            )
        except ACTION_ERRORS as exc:
            message = getattr(exc, "message", None) or str(exc)
            self.message_user(request, f"{capability.full_name}: {message}", level=messages.ERROR)
            return HttpResponseRedirect(change_url)
        restored_as = result.version.number
        if result.version.pk == serving:
            self.message_user(
                request, f"{capability.full_name} already serves the code of v{number}.", level=messages.WARNING
            )
        elif result.pending:
            self.log_change(request, capability, f"Rolled back to v{number} (v{restored_as}, being placed)")
            self.message_user(
                request,
                f"The code of v{number} is being placed as v{restored_as}; "
                f"{capability.full_name} serves it once placed.",
            )
        else:
            self.log_change(request, capability, f"Rolled back to v{number} (now v{restored_as})")
            self.message_user(
                request, f"Rolled {capability.full_name} back to the code of v{number}, now v{restored_as}."
            )
        return HttpResponseRedirect(change_url)

    def split_view(self, request, object_id, action):
        """Change, promote or abort a traffic split: a confirmation page, then the service."""
        if action not in SPLIT_ACTIONS:
            raise Http404(f"no split action {action}")
        capability = get_object_or_404(
            Capability.objects.select_related("agent", "current_version", "staged_version"), pk=object_id
        )
        if not self.has_change_permission(request, capability):
            raise PermissionDenied
        change_url = reverse("admin:capabilities_capability_change", args=[capability.pk])
        form = SplitForm(request.POST or None, initial=SplitForm.initial_for(capability))
        if request.method == "POST" and (action != "set" or form.is_valid()):
            actor = owner_actor(request)
            try:
                if action == "set":
                    services.capability_split_set(capability=capability, actor=actor, **form.split_arguments())
                elif action == "promote":
                    services.capability_promote(capability=capability, actor=actor)
                else:
                    services.capability_split_abort(capability=capability, actor=actor)
            except ACTION_ERRORS as exc:
                message = getattr(exc, "message", None) or str(exc)
                self.message_user(request, f"{capability.full_name}: {message}", level=messages.ERROR)
                return HttpResponseRedirect(change_url)
            self.log_change(request, capability, SPLIT_ACTIONS[action][0])
            self.message_user(request, f"{capability.full_name}: {SPLIT_ACTIONS[action][1]}")
            return HttpResponseRedirect(change_url)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"{SPLIT_ACTIONS[action][0]}: {capability.full_name}",
            "capability": capability,
            "action": action,
            "question": SPLIT_ACTIONS[action][0],
            "form": form if action == "set" else None,
        }
        return TemplateResponse(request, "admin/capabilities/capability/split_confirm.html", context)

    def _each(self, request, queryset, slug: str, done: str):
        """Run one of PAGE_ACTIONS on each selected capability: asked first when destructive
        (the confirmation page lists them and posts the selection back), then one service
        call each; count those it changed, report each failure, and write each change to the
        admin's history (the service writes the audit trail)."""
        action = PAGE_ACTIONS_BY_SLUG[slug]
        selected = list(queryset.select_related("agent").exclude(state=State.REMOVED))
        if action.confirm and request.POST.get("confirmed") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "opts": self.opts,
                "title": f"{action.label}: are you sure?",
                "subject": ", ".join(c.full_name for c in selected) or "no capability",
                "subject_url": reverse("admin:capabilities_capability_changelist"),
                "changelist_url": reverse("admin:capabilities_capability_changelist"),
                "action": action.label,
                "what": action.confirm,
                "fields": {"action": request.POST.get("action", ""), "confirmed": "yes"},
                "selected": [c.pk for c in selected],
            }
            return TemplateResponse(request, "admin/sigil/confirm.html", context)
        actor = owner_actor(request)
        changed = 0
        for capability in selected:
            try:
                result = action.run(capability, actor)
            except ACTION_ERRORS as exc:
                message = getattr(exc, "message", None) or str(exc)
                self.message_user(request, f"{capability.full_name}: {message}", level=messages.ERROR)
                continue
            if result is None or bool(result):
                changed += 1
                self.log_change(request, capability, action.label)
        self.message_user(request, done.format(plural(changed)))
        return None

    @admin.action(description="Make selected capabilities public…")
    def make_public(self, request, queryset):
        return self._each(request, queryset, "make-public", "Made {} public.")

    @admin.action(description="Make selected capabilities private…")
    def make_private(self, request, queryset):
        return self._each(request, queryset, "make-private", "Made {} private.")

    @admin.action(description="Reset the circuit breaker of selected capabilities")
    def reset_breakers(self, request, queryset):
        return self._each(request, queryset, "reset-breaker", "Reset the breaker of {}.")

    @admin.action(description="Force selected capabilities degraded (503 until reset)…")
    def force_degraded(self, request, queryset):
        return self._each(request, queryset, "force-degraded", "Forced {} degraded; reset the breaker to serve again.")

    @admin.action(description="Page in selected capabilities (place them on the runtime)")
    def page_in(self, request, queryset):
        return self._each(request, queryset, "page-in", "Paged in {}.")

    @admin.action(description="Evict selected capabilities (page them out)…")
    def evict(self, request, queryset):
        return self._each(request, queryset, "evict", "Evicted {}.")

    @admin.action(description="Remove selected capabilities…")
    def remove_capabilities(self, request, queryset):
        return self._each(request, queryset, "remove", "Removed {}.")


# action → (what the confirmation page asks, what is said once done)
SPLIT_ACTIONS = {
    "set": ("Split traffic", "the split is set."),
    "promote": ("Promote the staged version", "the staged version is current; the split has ended."),
    "abort": ("Abort the split", "the split has ended; every call goes to the current version."),
}


def split_panel(capability: Capability) -> str:
    """The staged version and the split, versions side by side, with links to change them."""
    if capability.staged_version_id is None:
        return 'no staged version (an agent stages one by deploying with "stage": true)'
    links = format_html_join(
        " ",
        '<a class="button" href="{}" id="split-{}">{}</a>',
        (
            (reverse("admin:capabilities_capability_split", args=[capability.pk, action]), action, words[0])
            for action, words in SPLIT_ACTIONS.items()
        ),
    )
    report = selectors.capability_split_report(capability=capability)
    if report is None:
        return format_html("v{} is staged, not in traffic. {}", capability.staged_version.number, links)
    rows = []
    for role in ("current", "staged"):
        version = report[role]
        figures = version["stats"] or {}
        rate = figures.get("error_rate")
        rows.append(
            (
                role,
                version["version"],
                f"{version['weight']} %",
                figures.get("calls", 0),
                figures.get("errors", 0),
                "–" if rate is None else f"{100 * rate:.1f} %",
                "–" if figures.get("p50_ms") is None else f"{figures['p50_ms']:.1f} ms",
                figures.get("state", "–"),
                figures.get("breaker", "–"),
            )
        )
    guard = report["guard"]
    staged = capability.variants.exclude(state=State.REMOVED).filter(breaker_state=BreakerState.OPEN).first()
    if staged is not None:  # its breaker has no page of its own: reset it from here
        links = format_html(
            '{} <a class="button" href="{}" id="split-reset-breaker">Reset the staged version\'s breaker</a>',
            links,
            reverse("admin:capabilities_capability_action", args=[staged.pk, "reset-breaker"]),
        )
    return format_html(
        '<table id="split"><thead><tr><th></th><th>version</th><th>share</th><th>calls</th><th>errors</th>'
        "<th>error rate</th><th>p50</th><th>state</th><th>breaker</th></tr></thead><tbody>{}</tbody></table>"
        "<p>Since {}; callers keyed by {}; guard: {}.</p><p>{}</p>",
        format_html_join("", "<tr>" + "<td>{}</td>" * 9 + "</tr>", rows),
        report["started_at"].strftime("%Y-%m-%d %H:%M:%S"),
        report["caller_header"] or "their invoke token",
        f"abort past {100 * guard['margin']:.0f} points over {guard['min_calls']} calls" if guard else "off",
        links,
    )


class SplitForm(forms.Form):
    weight = forms.IntegerField(min_value=0, max_value=100, help_text="Percent of callers sent to the staged version.")
    caller_header = forms.CharField(
        required=False, help_text="The header whose value keeps a caller on one version; empty: its invoke token."
    )
    guard_margin = forms.FloatField(
        required=False,
        min_value=0,
        max_value=1,
        help_text="Abort by itself when the staged error rate exceeds the current one's by this share (0.1 = 10 "
        "points); empty: no guard.",
    )
    guard_min_calls = forms.IntegerField(required=False, min_value=1, help_text="Calls to the staged version first.")

    @staticmethod
    def initial_for(capability: Capability) -> dict:
        return {
            "weight": capability.split_weight if capability.has_split else 10,
            "caller_header": capability.split_caller_header,
            "guard_margin": capability.split_guard_margin,
            "guard_min_calls": capability.split_guard_min_calls,
        }

    def split_arguments(self) -> dict:
        data = self.cleaned_data
        guard = None
        if data["guard_margin"] is not None:
            guard = services.SplitGuard(
                margin=data["guard_margin"], min_calls=data["guard_min_calls"] or services.SplitGuard.min_calls
            )
        return {"weight": data["weight"], "caller_header": data["caller_header"], "guard": guard}


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

    refusals = ACTION_ERRORS

    inlines = [*BaseAgentAdmin.inlines, AgentGrantInline]


@admin.register(Binding)
class BindingAdmin(GrantsSavedByServices, SelectionChecked, RefusalsAsMessages, admin.ModelAdmin):
    refusals = ACTION_ERRORS
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
