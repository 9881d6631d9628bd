"""The admin login's lock-out: a page that says for how long, and `manage.py axes_reset`
lifting it (django-axes counting in Redis)."""

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client


@pytest.fixture
def owner_account(transactional_db):
    get_user_model().objects.create_superuser("owner", "owner@example.invalid", "the-right-password")


def sign_in(client: Client, password: str):
    return client.post("/admin/login/?next=/admin/", {"username": "owner", "password": password, "next": "/admin/"})


def test_a_locked_out_address_is_told_for_how_long_and_axes_reset_lifts_it(owner_account, settings):
    settings.AXES_FAILURE_LIMIT = 3
    settings.SIGIL_ADMIN_LOCKOUT_SECONDS = 900  # as AXES_COOLOFF_TIME, 15 minutes
    client = Client()
    for _ in range(2):
        assert sign_in(client, "wrong").status_code == 200  # the form again
    locked = sign_in(client, "wrong")
    assert locked.status_code == 429
    page = " ".join(locked.content.decode().split())
    assert 'id="locked-out"' in page and "for 15 minutes after the last failure" in page
    assert "about 15 minutes from now" in page and "axes_reset" in page
    assert 'href="/admin/login/"' in page and "<title>" in page  # the admin's page, not bare text
    assert sign_in(client, "the-right-password").status_code == 429  # the right password too

    out = io.StringIO()
    call_command("axes_reset", stdout=out)
    assert out.getvalue().strip() == "1 attempts removed."
    assert sign_in(client, "the-right-password").status_code == 302  # signed in
    out = io.StringIO()
    call_command("axes_reset", stdout=out)
    assert out.getvalue().strip() == "No attempts found."


def test_a_browser_that_signs_in_is_trusted_only_while_trusted_devices_are_on(owner_account, settings):
    settings.AXES_FAILURE_LIMIT = 2
    settings.SIGIL_ADMIN_TRUSTED_DEVICE_DAYS = 0  # off: no device cookie, the address alone counts
    trusted = Client()
    assert sign_in(trusted, "the-right-password").status_code == 302
    assert "sigil_device" not in trusted.cookies
    guesser = Client()
    for _ in range(2):
        sign_in(guesser, "wrong")
    assert sign_in(Client(), "the-right-password").status_code == 429

    call_command("axes_reset", stdout=io.StringIO())
    settings.SIGIL_ADMIN_TRUSTED_DEVICE_DAYS = 30
    assert sign_in(trusted, "the-right-password").status_code == 302
    device = trusted.cookies["sigil_device"]
    assert device["httponly"] and device["path"] == "/admin/" and device["max-age"] == 30 * 86400
    for _ in range(2):
        sign_in(guesser, "wrong")
    returning = Client()
    returning.cookies["sigil_device"] = device.value
    assert sign_in(returning, "the-right-password").status_code == 302  # the address's lock-out is not its
