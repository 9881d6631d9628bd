"""The owner's account: the Django superuser who runs this Sigil from the admin; and the
random password Sigil gave it, kept for `make run`'s banner until the owner first signs in."""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass, replace
from pathlib import Path

from django.contrib.auth import get_user_model
from django.db import transaction

OWNER_USERNAME = "owner"


@dataclass(frozen=True)
class OwnerAccount:
    username: str
    created: bool
    #: the random password Sigil gave the account: set when it was created just now, and by
    #: `owner_ensure_shown` as long as the owner has not signed in with it
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


#: where runsigil keeps the owner's generated password, under SIGIL_VAR_DIR, until the first sign-in
FIRST_PASSWORD_FILE = "owner-password"


def owner_ensure_shown(*, password: str = "", var_dir: Path) -> OwnerAccount:
    """`owner_ensure`, for a start that shows the owner how to sign in (runsigil's banner): the
    password Sigil generated is returned at each start, not only the first, until the owner
    signs in with it or it is changed (it is kept under `var_dir` till then)."""
    owner = owner_ensure(password=password)
    if owner.generated_password:
        owner_password_keep(var_dir=var_dir, password=owner.generated_password)
        return owner
    return replace(owner, generated_password=owner_password_unused(var_dir=var_dir, username=owner.username))


def owner_password_keep(*, var_dir: Path, password: str) -> None:
    """Keep the password Sigil generated for the owner, readable by this user alone, so that
    each start shows it until the owner signs in (`owner_password_unused`)."""
    path = var_dir / FIRST_PASSWORD_FILE
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as kept:
        kept.write(password)


def owner_password_unused(*, var_dir: Path, username: str) -> str | None:
    """The password Sigil generated for the owner `username`, while they have never signed in
    and it is still theirs; otherwise None, and it is no longer kept."""
    path = var_dir / FIRST_PASSWORD_FILE
    try:
        password = path.read_text()
    except FileNotFoundError:
        return None
    owner = get_user_model().objects.filter(**{get_user_model().USERNAME_FIELD: username}).first()
    if owner is None or owner.last_login is not None or not owner.check_password(password):
        path.unlink(missing_ok=True)
        return None
    return password


def owner_password_forget(*, var_dir: Path) -> None:
    """The owner signed in: the password Sigil generated is no longer kept. Idempotent."""
    with contextlib.suppress(FileNotFoundError):
        (var_dir / FIRST_PASSWORD_FILE).unlink()
