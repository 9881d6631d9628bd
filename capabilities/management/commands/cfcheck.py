"""`python manage.py cfcheck [--backend BACKEND] [--json]`: whether the Cloudflare account can run a
Cloudflare runtime."""

from dataclasses import asdict

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from capabilities.services.cfcheck import CLOUDFLARE_BACKENDS, cloudflare_check
from sigil.errors import InvalidRequest
from sigil.owner_commands import OwnerCommand, argument


class Command(OwnerCommand):
    """Check the Cloudflare account (CF_ACCOUNT_ID, CF_API_TOKEN) before switching to a Cloudflare runtime:
    the token, the account, its workers.dev subdomain, the plan's features and the script quota.
    Exits non-zero when the runtime cannot work there."""

    arguments = (
        argument("--backend", choices=CLOUDFLARE_BACKENDS, help="The runtime to check for (default: SIGIL_BACKEND)."),
    )

    def act(self, *, backend: str | None, **options) -> dict:
        backend = backend or settings.SIGIL_BACKEND
        try:
            result = cloudflare_check(backend=backend)
        except (ValueError, ImproperlyConfigured) as exc:
            raise InvalidRequest(str(exc)) from exc
        return {
            "backend": backend,
            "account": settings.CF_ACCOUNT_ID,
            "ready": result.ready,
            "findings": [asdict(finding) for finding in result.findings],
        }

    def describe(self, result: dict) -> str:
        lines = []
        for finding in result["findings"]:
            mark = "ok" if finding["ok"] else ("MISSING" if finding["blocking"] else "note")
            lines.append(f"{mark:<8}{finding['topic']}: {finding['detail']}")
        if result["ready"]:
            lines.append(f"the {result['backend']} runtime can work on account {result['account']}")
        return "\n".join(lines)

    def refusal(self, result: dict) -> str | None:
        if result["ready"]:
            return None
        return f"the {result['backend']} runtime cannot work on this account: see what is MISSING above"
