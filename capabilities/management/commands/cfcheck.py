"""`python manage.py cfcheck`: whether the Cloudflare account can run a Cloudflare runtime."""

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError

from capabilities.services.cfcheck import CLOUDFLARE_BACKENDS, cloudflare_check
from sigil.owner_commands import SigilCommand, argument


class Command(SigilCommand):
    """Check the Cloudflare account (CF_ACCOUNT_ID, CF_API_TOKEN) before switching to a Cloudflare runtime:
    the token, the account, its workers.dev subdomain, the plan's features and the script quota.
    Exits non-zero when the runtime cannot work there."""

    arguments = (
        argument("--backend", choices=CLOUDFLARE_BACKENDS, help="The runtime to check for (default: SIGIL_BACKEND)."),
    )

    def handle(self, *args, backend: str | None, **options) -> None:
        backend = backend or settings.SIGIL_BACKEND
        try:
            result = cloudflare_check(backend=backend)
        except (ValueError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc)) from exc
        for finding in result.findings:
            mark = "ok" if finding.ok else ("MISSING" if finding.blocking else "note")
            self.stdout.write(f"{mark:<8}{finding.topic}: {finding.detail}")
        if not result.ready:
            raise CommandError(f"the {backend} runtime cannot work on this account: see what is MISSING above")
        self.stdout.write(f"the {backend} runtime can work on account {settings.CF_ACCOUNT_ID}")
