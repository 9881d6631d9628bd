import pytest
from django.contrib.auth import get_user_model

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
