"""`python manage.py deployruntime`: create what SIGIL_BACKEND's runtime needs on Cloudflare
(the platform runtime's dispatch namespace and dispatch Worker, the loader runtime's KV
namespace and loader Worker; with the edge on, its KV namespace, and on worker-pool its
Worker `sigil-edge`), then check that it serves."""

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from capabilities import services
from capabilities.runtimes import get_runtime
from capabilities.runtimes.errors import RuntimeFailure


class Command(BaseCommand):
    help = (
        "Deploy Sigil's own Worker for SIGIL_BACKEND (the dispatch Worker for platform, the loader Worker "
        "for loader, with the edge on the edge Worker for worker-pool) and what it binds, when missing or "
        "out of date; then check it answers. Idempotent."
    )

    def handle(self, *args, **options) -> None:
        try:
            done = services.runtime_provision(actor="owner:cli")
            get_runtime().check()
        except RuntimeFailure as exc:
            raise CommandError(f"{settings.SIGIL_BACKEND}: {exc}") from exc
        for line in done:
            self.stdout.write(line)
        self.stdout.write(f"{settings.SIGIL_BACKEND}: {'up to date' if not done else 'ready'}")
