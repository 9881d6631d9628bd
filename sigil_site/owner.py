"""The owner's account: the Django superuser who runs this Sigil from the admin."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db import transaction

OWNER_USERNAME = "owner"


@dataclass(frozen=True)
class OwnerAccount:
    username: str
    created: bool
    #: set only when the account was created just now with a random password
    generated_password: str | None = None


@transaction.atomic
def owner_ensure(*, password: str = "") -> OwnerAccount:
    """Create the `owner` superuser when no superuser exists, with `password` or a random one.

    A random password is returned once and stored only as a hash. Idempotent: when any
    superuser exists, nothing changes and the first one is named.
    """
    User = get_user_model()
    existing = User.objects.filter(is_superuser=True).order_by("pk").first()
    if existing is not None:
        return OwnerAccount(username=existing.get_username(), created=False)
    generated = None if password else secrets.token_urlsafe(12)
    user, _ = User.objects.get_or_create(**{User.USERNAME_FIELD: OWNER_USERNAME})
    user.is_staff = True
    user.is_superuser = True
    user.is_active = True
    user.set_password(password or generated)
    user.save()
    return OwnerAccount(username=OWNER_USERNAME, created=True, generated_password=generated)
