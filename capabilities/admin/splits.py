"""The splits console: a capability's staged version and the traffic split between it and
the current one, and setting, promoting or aborting that split."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from capabilities import selectors, services
from capabilities.admin.console import ACTION_ERRORS, capability_for, say_refused
from capabilities.models import BreakerState, Capability, State
from sigil.console import fragment, owner_actor

# action → (what the confirmation page asks, what is said once done)
SPLIT_ACTIONS = {
    "set": ("Split traffic", "the split is set."),
    "promote": ("Promote the staged version", "the staged version is current; the split has ended."),
    "abort": ("Abort the split", "the split has ended; every call goes to the current version."),
}


def split_rows(report: dict) -> list[tuple]:
    """The split's table: for the current and the staged version, its share and its figures."""
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
    return rows


def split_panel(capability: Capability) -> str:
    """The staged version and the split, versions side by side, with links to change them."""
    if capability.staged_version_id is None:
        return 'no staged version (an agent stages one by deploying with "stage": true)'
    report = selectors.capability_split_report(capability=capability)
    context = {"capability": capability, "report": report, "actions": [(a, w[0]) for a, w in SPLIT_ACTIONS.items()]}
    if report is not None:
        guard = report["guard"]
        guarding = f"abort past {100 * guard['margin']:.0f} points over {guard['min_calls']} calls" if guard else "off"
        context |= {
            "rows": split_rows(report),
            "started_at": report["started_at"].strftime("%Y-%m-%d %H:%M:%S"),
            "keyed_by": report["caller_header"] or "their invoke token",
            "guard": guarding,
            # Its breaker has no page of its own: it is reset from here.
            "staged_open": capability.variants.exclude(state=State.REMOVED)
            .filter(breaker_state=BreakerState.OPEN)
            .first(),
        }
    return fragment("admin/capabilities/capability/split_panel.html", **context)


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


class SplitsConsole:
    """The capability admin's traffic split: the panel on its page, and the page that changes it."""

    @admin.display(description="versions in traffic")
    def split_panel(self, capability: Capability) -> str:
        return split_panel(capability)

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("<path:object_id>/split/<str:action>/", view(self.split_view), name="capabilities_capability_split"),
            *super().get_urls(),
        ]

    def split_view(self, request, object_id, action):
        """Change, promote or abort a traffic split: a confirmation page, then the service."""
        if action not in SPLIT_ACTIONS:
            raise Http404(f"no split action {action}")
        capability = capability_for(self, request, object_id, "current_version", "staged_version")
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
                say_refused(self, request, capability.full_name, exc)
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
