"""Every form of the owner's console, sent bad input, answers a page (a form error or a
message), never a 5xx: each registered model's add and change pages, and the capability
page's own forms (rollback, split, actions), through the real server's database and Redis."""

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from agents.models import Token
from capabilities.admin import PAGE_ACTIONS
from capabilities.models import Binding, Capability
from testsupport.capability_code import answering as code
from testsupport.cast import grant

# What an owner may type by mistake or on purpose: nothing, a bad name, numbers out of any
# range, a value longer than any field, a NUL byte, a date that is none.
BAD_VALUES = ["", "Not A Name!", "-1", "99999999999999999999", "x" * 400, "a\x00b", "2001-13-45"]


@pytest.fixture
def owner_client(sigil):
    user = get_user_model().objects.create_superuser("owner", "owner@example.invalid", "owner-password")
    client = Client(raise_request_exception=False)  # a 500 is an answer to check, not an exception
    client.force_login(user)
    return client


def page_fields(response) -> dict:
    """What the add or change page would post: its form's field names and its inlines'
    management forms, so that the inlines validate and the main form's data is what is judged."""
    data = {}
    for inline in response.context.get("inline_admin_formsets") or []:
        formset = inline.formset
        for name in formset.management_form.fields:
            data[f"{formset.prefix}-{name}"] = formset.management_form[name].value()
    form = response.context["adminform"].form
    for name, field in form.fields.items():
        widget_names = getattr(field.widget, "widgets_names", None)
        if widget_names:  # a split date and time posts name_0 and name_1
            data.update({f"{name}{suffix}": "" for suffix in widget_names})
        else:
            data[name] = ""
    return data


MANAGEMENT = ("TOTAL_FORMS", "INITIAL_FORMS", "MIN_NUM_FORMS", "MAX_NUM_FORMS")


def with_every_field(data: dict, value: str) -> dict:
    """`data` with `value` in every field but the inlines' management forms."""
    return {key: v if key.endswith(MANAGEMENT) else value for key, v in data.items()}


@pytest.fixture
def everything(alice, bob, settings):
    """One of each thing the console edits: agents, tokens, a capability, a binding granted."""
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 0
    alice.deploy(name="kept", code=code("kept"))
    grant(Binding.objects.create(kind="VAR", name="GREETING", value="hello"), "alice")
    return Capability.objects.get(full_name="alice--kept")


def test_every_admin_form_answers_bad_input_without_a_5xx(owner_client, everything):
    answered, failed = [], []
    for model in admin.site._registry:
        opts = model._meta
        pages = []
        add_url = reverse(f"admin:{opts.app_label}_{opts.model_name}_add")
        if owner_client.get(add_url).status_code == 200:
            pages.append(add_url)
        first = model.objects.order_by("pk").first()
        if first is not None:
            pages.append(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[first.pk]))
        for url in pages:
            shown = owner_client.get(url)
            assert shown.status_code == 200, url
            fields = page_fields(shown)
            for value in BAD_VALUES:
                answer = owner_client.post(url, with_every_field(fields, value), follow=True)
                if answer.status_code >= 500:
                    failed.append((url, value))
                answered.append(url)
    assert failed == []
    # The pages that matter were reached: adding an agent, a token and a binding, editing each.
    assert {"/admin/agents/agent/add/", "/admin/agents/token/add/", "/admin/capabilities/binding/add/"} <= set(answered)


def test_the_capability_pages_own_forms_answer_bad_input_without_a_5xx(owner_client, everything):
    capability = everything
    base = f"/admin/capabilities/capability/{capability.pk}"
    for value in [*BAD_VALUES, "1", "2", "0"]:
        for method in (owner_client.get, owner_client.post):
            assert method(f"{base}/rollback/", {"version": value}, follow=True).status_code < 500
        split = {"weight": value, "caller_header": value, "guard_margin": value, "guard_min_calls": value}
        assert owner_client.post(f"{base}/split/set/", split, follow=True).status_code < 500
    for action in ("promote", "abort"):
        assert owner_client.post(f"{base}/split/{action}/", follow=True).status_code < 500
    for action in PAGE_ACTIONS:  # each twice: the second finds its work done, or refuses
        for _ in range(2):
            assert owner_client.post(f"{base}/actions/{action.slug}/", follow=True).status_code < 500
    token = Token.objects.filter(agent__name="alice").first()
    for _ in range(2):
        assert owner_client.post(f"/admin/agents/token/{token.pk}/revoke/", follow=True).status_code < 500
    for query in ("span=10y&agent=nobody&refresh=maybe", "span=&agent="):
        assert owner_client.get(f"/admin/dashboard/?{query}").status_code == 200


def test_every_list_action_answers_a_bad_selection_without_a_5xx(owner_client, everything):
    failed = []
    for model, model_admin in admin.site._registry.items():
        opts = model._meta
        url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        request = owner_client.get(url).wsgi_request
        actions = [*model_admin.get_actions(request), "no_such_action"]
        first = model.objects.order_by("pk").first()
        selections = [["abc"], ["99999999999999999999"], [str(first.pk)] if first else []]
        for action in actions:
            for selected in selections:
                for confirmed in ("", "yes"):
                    data = {"action": action, "_selected_action": selected, "index": "0", "confirmed": confirmed}
                    answer = owner_client.post(url, data, follow=True)
                    if answer.status_code >= 500:
                        failed.append((url, action, selected, confirmed))
    assert failed == []
