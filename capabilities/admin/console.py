"""What the capabilities' consoles share: the errors an action may meet, how a refusal is
said, and the capability a page acts on."""

from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404

from capabilities.models import Capability
from capabilities.runtimes.errors import RuntimeFailure
from sigil.console import refusal_text
from sigil.errors import SigilError

# What an action may fail with: Sigil's API errors, and a runtime failing under it.
ACTION_ERRORS = (SigilError, RuntimeFailure)


def say_refused(model_admin: admin.ModelAdmin, request, subject: str, exc: Exception) -> None:
    """Say an action's refusal as an error message naming what it was done to."""
    model_admin.message_user(request, f"{subject}: {refusal_text(exc)}", level=messages.ERROR)


def capability_for(model_admin: admin.ModelAdmin, request, object_id, *related: str, change: bool = True) -> Capability:
    """The capability a page of its own acts on: 404 when there is none, 403 when the owner
    may not change it (or, with `change=False`, not even view it)."""
    capability = get_object_or_404(Capability.objects.select_related("agent", *related), pk=object_id)
    allowed = model_admin.has_change_permission if change else model_admin.has_view_permission
    if not allowed(request, capability):
        raise PermissionDenied
    return capability
