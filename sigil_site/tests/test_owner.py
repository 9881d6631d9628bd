from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import override_settings

from sigil_site.owner import FIRST_PASSWORD_FILE, owner_ensure, owner_ensure_shown

pytestmark = pytest.mark.django_db


def test_owner_is_created_with_a_random_password_returned_once():
    account = owner_ensure()

    owner = get_user_model().objects.get(username="owner")
    assert account.created
    assert owner.is_superuser
    assert owner.is_staff
    assert owner.check_password(account.generated_password)
    assert len(account.generated_password) >= 16


def test_a_given_password_is_used_and_not_returned():
    account = owner_ensure(password="correct horse battery staple")

    assert account.generated_password is None
    assert get_user_model().objects.get(username="owner").check_password("correct horse battery staple")


def test_nothing_changes_when_a_superuser_exists():
    get_user_model().objects.create_superuser("root", password="kept")

    account = owner_ensure(password="ignored")

    assert account.username == "root"
    assert not account.created
    assert not get_user_model().objects.filter(username="owner").exists()
    assert owner_ensure().generated_password is None


def test_ensureowner_creates_the_owner_once_and_says_so(settings):
    settings.SIGIL_OWNER_PASSWORD = ""
    out = StringIO()
    call_command("ensureowner", stdout=out)
    password = out.getvalue().split("password ", 1)[1].split(",", 1)[0]
    owner = get_user_model().objects.get(username="owner")
    assert owner.is_superuser and owner.check_password(password)
    again = StringIO()
    call_command("ensureowner", stdout=again)
    assert "exists; unchanged" in again.getvalue() and "password" not in again.getvalue()
    assert get_user_model().objects.get(username="owner").check_password(password)


def test_each_start_shows_the_generated_password_until_the_owner_signs_in(client, tmp_path):
    first = owner_ensure_shown(var_dir=tmp_path)
    assert first.created and first.generated_password
    assert oct((tmp_path / FIRST_PASSWORD_FILE).stat().st_mode & 0o777) == "0o600"
    # Sigil restarted before the owner signed in: the same password, still usable.
    again = owner_ensure_shown(var_dir=tmp_path)
    assert not again.created and again.generated_password == first.generated_password

    with override_settings(VAR_DIR=tmp_path):
        signed_in = client.post("/admin/login/", {"username": "owner", "password": first.generated_password})
    assert signed_in.status_code == 302, signed_in.content
    assert not (tmp_path / FIRST_PASSWORD_FILE).exists()  # no longer kept once used
    assert owner_ensure_shown(var_dir=tmp_path).generated_password is None


def test_a_changed_password_is_not_shown(tmp_path):
    first = owner_ensure_shown(var_dir=tmp_path)
    owner = get_user_model().objects.get(username="owner")
    owner.set_password("the owner's own")
    owner.save()
    assert owner_ensure_shown(var_dir=tmp_path).generated_password is None
    assert not (tmp_path / FIRST_PASSWORD_FILE).exists()
    assert first.generated_password


def test_a_password_from_settings_is_never_kept(tmp_path):
    assert owner_ensure_shown(password="correct horse battery staple", var_dir=tmp_path).generated_password is None
    assert not (tmp_path / FIRST_PASSWORD_FILE).exists()
