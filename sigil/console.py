"""What every console of the owner's admin shares: the actor it names in the audit trail,
refusals said as messages, checked selections, table-driven list filters, read-only pages,
page fragments from templates, and the page that asks before a destructive change."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import ValidationError
from django.db.models import Q
from django.http import HttpRequest, HttpResponseRedirect
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe

from sigil.errors import SigilError


def owner_actor(request: HttpRequest) -> str:
    return f"owner:{request.user.get_username()}"


def refusal_text(exc: Exception) -> str:
    """What the owner reads of a service's refusal: its message, else the exception's text."""
    return getattr(exc, "message", None) or str(exc)


def fragment(template_name: str, **context) -> SafeString:
    """A piece of a page (a read-only field, a list cell) rendered from its template, without
    the template file's trailing newline."""
    return mark_safe(render_to_string(template_name, context).strip())


def confirm_page(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    *,
    action: str,
    subject: str,
    what: str,
    subject_url: str | None = None,
    fields: dict | None = None,
    selected: list | None = None,
) -> TemplateResponse:
    """The page that asks before a destructive change; its form posts back to the same URL.
    For a list action (`selected` given) it posts the selection back, confirmed, and its
    subject links to the list."""
    changelist_url = reverse(f"admin:{model_admin.opts.app_label}_{model_admin.opts.model_name}_changelist")
    if selected is not None:
        fields = {"action": request.POST.get("action", ""), "confirmed": "yes"}
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "title": f"{action}: are you sure?",
        "subject": subject,
        "subject_url": subject_url or changelist_url,
        "changelist_url": changelist_url,
        "action": action,
        "what": what,
        "fields": fields or {},
        "selected": selected or [],
    }
    return TemplateResponse(request, "admin/sigil/confirm.html", context)


def confirmed(request: HttpRequest) -> bool:
    """Whether a list action's confirmation page was answered yes."""
    return request.POST.get("confirmed") == "yes"


class OptionsFilter(admin.SimpleListFilter):
    """A list filter from a table: each option's value, its label, and the condition it
    applies (a function, so that a condition on the time reads the clock when it filters)."""

    options: dict[str, tuple[str, Callable[[], Q]]] = {}

    def lookups(self, request, model_admin):
        return [(value, label) for value, (label, _) in self.options.items()]

    def queryset(self, request, queryset):
        option = self.options.get(self.value() or "")
        return queryset.filter(option[1]()) if option else queryset


class ButtonsOnly:
    """A change page whose every field is read-only: it changes things through its buttons
    and actions, so it offers no Save."""

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = {
            **(extra_context or {}),
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
        }
        return super().change_view(request, object_id, form_url, extra_context)


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
        self.message_user(request, refusal_text(exc), level=messages.ERROR)
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
