"""The versions console: a capability's versions, one version's code and contract with their
differences from another, and rolling back to an earlier version."""

from __future__ import annotations

import difflib
import json

from django.contrib import admin, messages
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from capabilities import selectors, services
from capabilities.admin.console import ACTION_ERRORS, capability_for, say_refused
from capabilities.contracts import Contract
from capabilities.models import Capability, CapabilityVersion, State, VersionPlacement
from sigil.console import confirm_page, fragment, owner_actor


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


def version_standing(capability: Capability, version: CapabilityVersion, never_served: set[int]) -> str:
    """What the versions panel says of a version, by its template's names: `current`,
    `staged`, `never-served`, `placing`, `failed`, `rollback` (it may be rolled back to) or ``."""
    if version.pk == capability.current_version_id:
        return "current"
    if version.pk == capability.staged_version_id:
        return "staged"
    if version.number in never_served:
        # Rolling back to it would serve code that never passed a split's guard.
        return "never-served"
    if version.placement == VersionPlacement.PLACING:
        return "placing"
    if version.placement == VersionPlacement.FAILED:
        return "failed"
    return "rollback" if capability.state != State.REMOVED else ""


class VersionsConsole:
    """The capability admin's versions: the panel on its page, and the pages of its own."""

    @admin.display(description="all versions")
    def versions_panel(self, capability: Capability) -> str:
        never_served = selectors.capability_versions_never_served(capability=capability)
        rows = []
        for version in capability.versions.order_by("-number"):
            failure = version.failure or {}
            refused = failure.get("message") or failure.get("code") or "refused"
            rows.append((version, version_standing(capability, version, never_served), refused))
        return fragment("admin/capabilities/capability/versions_panel.html", capability=capability, rows=rows)

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
        capability = capability_for(self, request, object_id, change=False)
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

    def rollback_view(self, request, object_id):
        """Roll back to `version`: GET asks (the confirmation page), POST does it."""
        if request.method not in ("GET", "POST"):
            return HttpResponseNotAllowed(["GET", "POST"])
        capability = capability_for(self, request, object_id, "current_version")
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
            return confirm_page(
                self,
                request,
                action=f"Roll back to v{number}",
                subject=capability.full_name,
                subject_url=reverse("admin:capabilities_capability_change", args=[capability.page_id]),
                what=what,
                fields={"version": number},
            )
        serving = capability.current_version_id
        try:
            result = services.capability_rollback(
                capability=capability, version_number=number, actor=owner_actor(request)
            )
        except ACTION_ERRORS as exc:
            say_refused(self, request, capability.full_name, exc)
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
