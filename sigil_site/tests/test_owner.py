from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from sigil_site.owner import owner_ensure

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
