"""The bindings console: what the owner offers capabilities (resources, variables, secrets),
and which agents' capabilities may declare each, granted on the binding's page or the agent's."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages

from agents.admin import AgentAdmin as BaseAgentAdmin
from agents.models import Agent
from capabilities import bindings as binding_rules
from capabilities import selectors, services
from capabilities.admin.console import ACTION_ERRORS
from capabilities.models import Binding, BindingGrant, BindingKind, Capability
from sigil.console import RefusalsAsMessages, SelectionChecked, fragment, owner_actor
from sigil.errors import SigilError


def declared_bindings(capability: Capability) -> str:
    """A capability's declared bindings, each with what it stands for, or why it is left out."""
    if not capability.bindings:
        return "none declared"
    offered = {str(b): b for b in Binding.objects.all()}
    granted = set(BindingGrant.objects.filter(agent_id=capability.agent_id).values_list("binding_id", flat=True))
    items = []
    for declaration in capability.bindings:
        binding = offered.get(declaration)
        items.append((declaration, binding, binding is not None and binding.pk in granted))
    return fragment("admin/capabilities/capability/bindings.html", capability=capability, items=items)


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
