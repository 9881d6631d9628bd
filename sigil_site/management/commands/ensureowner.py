"""`manage.py ensureowner`: the owner's admin account, the same step whatever starts Sigil."""

from __future__ import annotations

from django.conf import settings

from sigil.owner_commands import SigilCommand
from sigil_site.owner import owner_ensure


class Command(SigilCommand):
    """Create the owner's admin account (user owner) when no superuser exists, with
    SIGIL_OWNER_PASSWORD or a random password printed once; otherwise change nothing.
    Run it after migrate on each release, as make run does."""

    def handle(self, *args, **options) -> None:
        owner = owner_ensure(password=settings.SIGIL_OWNER_PASSWORD)
        if owner.generated_password:
            self.stdout.write(
                f"Owner account: user {owner.username}, password {owner.generated_password}, shown only this once"
            )
        elif owner.created:
            self.stdout.write(f"Owner account: user {owner.username}, password from SIGIL_OWNER_PASSWORD")
        else:
            self.stdout.write(f"Owner account: user {owner.username} (exists; unchanged)")
