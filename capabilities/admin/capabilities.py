"""The capabilities console: the list with its filters and bulk actions, and a capability's
page (how to call it, its breaker, traffic, failures, call records, code and its buttons)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from operator import attrgetter

from django.conf import settings
from django.contrib import admin
from django.db.models import Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone

from capabilities import services
from capabilities.admin.bindings import declared_bindings
from capabilities.admin.console import ACTION_ERRORS, capability_for, say_refused
from capabilities.admin.splits import SplitsConsole
from capabilities.admin.versions import VersionsConsole, contract_text
from capabilities.api import capability_url
from capabilities.books import breaker, call_logs, failures
from capabilities.dashboard import dashboard_chart, dashboard_get
from capabilities.models import BreakerState, Capability, State
from sigil.console import ButtonsOnly, OptionsFilter, SelectionChecked, confirm_page, confirmed, fragment, owner_actor
from sigil.serving import switch_command


class ExpiredEphemeralFilter(OptionsFilter):
    title = "expiry"
    parameter_name = "expiry"
    options = {
        "expired": ("expired, not yet removed", lambda: Q(expires_at__lte=timezone.now()) & ~Q(state=State.REMOVED)),
    }


class BreakerFilter(OptionsFilter):
    title = "health"
    parameter_name = "health"
    options = {
        "degraded": ("degraded (breaker open)", lambda: Q(breaker_state=BreakerState.OPEN)),
        "ok": ("breaker closed", lambda: Q(breaker_state=BreakerState.CLOSED)),
    }


class PlacementFilter(OptionsFilter):
    title = "runtime placement"
    parameter_name = "placement"
    options = {
        "placed": ("on the runtime (live or evicting)", lambda: Q(state__in=(State.LIVE, State.EVICTING))),
        "paged_out": ("paged out (a call pages it in)", lambda: Q(state=State.PAGED_OUT)),
        "no_slot": ("never placed", lambda: Q(slot="")),
    }


class InactiveFilter(OptionsFilter):
    title = "activity"
    parameter_name = "activity"
    options = {
        "inactive": ("marked inactive", lambda: Q(inactive_at__isnull=False)),
        "active": ("active", lambda: Q(inactive_at__isnull=True)),
    }


def plural(count: int) -> str:
    return f"{count} capability" if count == 1 else f"{count} capabilities"


def epoch_time(epoch: float | None) -> datetime | None:
    return None if epoch is None else timezone.localtime(datetime.fromtimestamp(epoch, tz=UTC))


@dataclass(frozen=True)
class PageAction:
    """A button on a capability's page and an action on the list: the service it calls, and
    for a destructive one, what the confirmation page says will happen."""

    slug: str
    label: str
    run: Callable[[Capability, str], object]  # (capability, actor) → the service's result
    done: str  # "{}" is the capability's name
    applies: Callable[[Capability, breaker.BreakerReport], bool]
    # The list action: its name, its words in the menu, and what is said once done ("{}" is
    # how many capabilities it changed).
    bulk: tuple[str, str, str]
    confirm: str = ""  # empty: no confirmation page


PAGE_ACTIONS = [
    PageAction(
        "reset-breaker",
        "Reset the breaker",
        lambda c, actor: services.capability_reset_breaker(capability=c, actor=actor),
        "Reset the breaker of {}: calls go through again.",
        lambda c, b: b.status != breaker.Status.CLOSED or c.breaker_state == BreakerState.OPEN,
        ("reset_breakers", "Reset the circuit breaker of selected capabilities", "Reset the breaker of {}."),
    ),
    PageAction(
        "force-degraded",
        "Force degraded",
        lambda c, actor: services.capability_force_degraded(capability=c, actor=actor),
        "Forced {} degraded; reset the breaker to serve again.",
        lambda c, b: b.status != breaker.Status.FORCED,
        (
            "force_degraded",
            "Force selected capabilities degraded (503 until reset)…",
            "Forced {} degraded; reset the breaker to serve again.",
        ),
        confirm="Every call will be answered 503 degraded, without running the code, until the breaker is reset.",
    ),
    PageAction(
        "page-in",
        "Page in",
        lambda c, actor: services.capability_page_in(full=c.full_name, reason=actor)[1],
        "Paged in {}.",
        lambda c, b: c.state in (State.PAGED_OUT, State.FAILED),
        ("page_in", "Page in selected capabilities (place them on the runtime)", "Paged in {}."),
    ),
    PageAction(
        "evict",
        "Evict",
        lambda c, actor: services.capability_evict(full=c.full_name, actor=actor),
        "Evicted {}; its next call pages it back in.",
        lambda c, b: c.state == State.LIVE,
        ("evict", "Evict selected capabilities (page them out)…", "Evicted {}."),
        confirm="Its script will be deleted from the runtime; the next call pages it back in (a cold start).",
    ),
    PageAction(
        "make-public",
        "Make public",
        lambda c, actor: services.capability_set_public(capability=c, is_public=True, actor=actor),
        "Made {} public.",
        lambda c, b: not c.is_public,
        ("make_public", "Make selected capabilities public…", "Made {} public."),
        confirm="Every agent may find and call it from the next request on, with its own invoke token; "
        "calls by other agents count in its traffic.",
    ),
    PageAction(
        "make-private",
        "Make private",
        lambda c, actor: services.capability_set_public(capability=c, is_public=False, actor=actor),
        "Made {} private.",
        lambda c, b: c.is_public,
        ("make_private", "Make selected capabilities private…", "Made {} private."),
        confirm="Other agents' calls to it are answered 404 from the next request on; only its own agent may call it.",
    ),
    PageAction(
        "remove",
        "Remove",
        lambda c, actor: services.capability_remove_as_owner(full=c.full_name, actor=actor),
        "Removed {}.",
        lambda c, b: True,
        ("remove_capabilities", "Remove selected capabilities…", "Removed {}."),
        confirm="It stops serving at once and its script is deleted; its versions and audit trail stay.",
    ),
]
PAGE_ACTIONS_BY_SLUG = {action.slug: action for action in PAGE_ACTIONS}


def bulk_action(slug: str) -> Callable:
    """One of PAGE_ACTIONS as an action of the list, named by its `bulk`."""
    action = PAGE_ACTIONS_BY_SLUG[slug]
    name, description, _ = action.bulk

    def run(model_admin: CapabilityAdmin, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return model_admin.run_on_selection(request, queryset, action)

    run.__name__ = name
    return admin.action(description=description)(run)


@admin.register(Capability)
class CapabilityAdmin(ButtonsOnly, VersionsConsole, SplitsConsole, SelectionChecked, admin.ModelAdmin):
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
        bulk_action(slug)
        for slug in ("make-public", "make-private", "reset-breaker", "force-degraded", "page-in", "evict", "remove")
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
    # Every field is read-only: the page changes things through its buttons and actions.
    readonly_fields = [field for _, options in fieldsets for field in options["fields"]]

    @admin.display(description="breaker", ordering="breaker_state")
    def health(self, capability: Capability) -> str:
        if capability.breaker_state == BreakerState.OPEN:
            return fragment("admin/capabilities/capability/degraded.html")
        return "ok"

    @admin.display(description="runtime")
    def runtime(self, capability: Capability) -> str:
        """Which runtime holds it, and a warning when that is not SIGIL_BACKEND's: the
        engine serves it there until a switch moves it, if that runtime still answers."""
        configured = settings.SIGIL_BACKEND
        placed = capability.state in (State.LIVE, State.EVICTING)
        backend = (capability.backend or configured) if placed else None
        failure = services.runtime_failure(backend) if placed and backend != configured else None
        return fragment(
            "admin/capabilities/capability/runtime.html",
            placed=placed,
            backend=backend,
            configured=configured,
            failure=failure,
            command=switch_command(configured),
        )

    @admin.display(description="placed bundle sha256")
    def placed_bundle(self, capability: Capability) -> str:
        # Not the version's code sha: the bundle also covers the bindings' values.
        if not capability.placed_sha:
            return "– (nothing placed)"
        return fragment("admin/capabilities/capability/placed_bundle.html", sha=capability.placed_sha)

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
        return declared_bindings(capability)

    def get_queryset(self, request):
        # A staged version in traffic is shown on its capability's page, not as one of its own.
        return super().get_queryset(request).filter(variant_of__isnull=True)

    def has_add_permission(self, request) -> bool:
        return False  # capabilities are deployed by agents over the API

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # "remove" keeps the versions and the trail

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = dict(extra_context or {})
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
        chart = dashboard_chart(
            day,
            title="Answers, last 24 hours",
            kind="bars",
            series=[(name, attrgetter(name), name) for name in ("calls", "errors", "refused")],
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
        page = call_logs.call_records_list(
            full=capability.full_name, query=call_logs.RecordQuery(level=level, request_id=request_id)
        )
        return {
            "call_records": [(r, epoch_time(r["at"])) for r in page.records],
            "call_records_level": level or "",
            "call_records_request": request_id or "",
            "call_records_levels": call_logs.LEVELS,
            "call_records_lost": call_logs.call_records_lost(full=capability.full_name),
            "call_records_kept": settings.SIGIL_LOGS_RECORDS_PER_CAPABILITY,
        }

    def get_urls(self):
        view = self.admin_site.admin_view(self.action_view)
        return [
            path("<path:object_id>/actions/<slug:slug>/", view, name="capabilities_capability_action"),
            *super().get_urls(),
        ]

    def action_view(self, request, object_id, slug):
        """One of PAGE_ACTIONS on one capability: asked first when destructive (GET shows the
        confirmation page), done on POST, written to the admin's history and, by the
        service, to the audit trail."""
        action = PAGE_ACTIONS_BY_SLUG.get(slug)
        if action is None:
            raise Http404(f"no action {slug}")
        capability = capability_for(self, request, object_id)
        change_url = reverse("admin:capabilities_capability_change", args=[capability.page_id])
        if request.method == "GET":
            what = action.confirm or f"{action.label}: {action.done.format(capability.full_name)}"
            return confirm_page(
                self, request, action=action.label, subject=capability.full_name, subject_url=change_url, what=what
            )
        if request.method != "POST":
            return HttpResponseNotAllowed(["GET", "POST"])
        try:
            action.run(capability, owner_actor(request))
        except ACTION_ERRORS as exc:
            say_refused(self, request, capability.full_name, exc)
            return HttpResponseRedirect(change_url)
        self.log_change(request, capability, action.label)
        self.message_user(request, action.done.format(capability.full_name))
        if slug == "remove":
            return HttpResponseRedirect(reverse("admin:capabilities_capability_changelist"))
        return HttpResponseRedirect(change_url)

    def run_on_selection(self, request, queryset, action: PageAction):
        """Run one of PAGE_ACTIONS on each selected capability: asked first when destructive
        (the confirmation page lists them and posts the selection back), then one service
        call each; count those it changed, report each failure, and write each change to the
        admin's history (the service writes the audit trail)."""
        selected = list(queryset.select_related("agent").exclude(state=State.REMOVED))
        if action.confirm and not confirmed(request):
            subject = ", ".join(c.full_name for c in selected) or "no capability"
            return confirm_page(
                self,
                request,
                action=action.label,
                subject=subject,
                what=action.confirm,
                selected=[c.pk for c in selected],
            )
        actor = owner_actor(request)
        changed = 0
        for capability in selected:
            try:
                result = action.run(capability, actor)
            except ACTION_ERRORS as exc:
                say_refused(self, request, capability.full_name, exc)
                continue
            if result is None or bool(result):
                changed += 1
                self.log_change(request, capability, action.label)
        self.message_user(request, action.bulk[2].format(plural(changed)))
        return None
