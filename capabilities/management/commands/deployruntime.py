"""`python manage.py deployruntime [--json]`: create what SIGIL_BACKEND's runtime needs on Cloudflare
(the platform runtime's dispatch namespace and dispatch Worker, the loader runtime's KV
namespace and loader Worker; with the edge on, its KV namespace, and on worker-pool its
Worker `sigil-edge`), then check that it serves."""

from django.conf import settings

from capabilities import services
from capabilities.runtimes import get_runtime
from capabilities.runtimes.errors import RuntimeFailure
from sigil.errors import UpstreamError
from sigil.owner_commands import CLI_ACTOR, OwnerCommand


class Command(OwnerCommand):
    """Deploy Sigil's own Worker for SIGIL_BACKEND (the dispatch Worker for platform, the loader Worker
    for loader, with the edge on the edge Worker for worker-pool) and what it binds, when missing or
    out of date; then check it answers. Idempotent."""

    def act(self, **options) -> dict:
        backend = settings.SIGIL_BACKEND
        try:
            done = services.runtime_provision(actor=CLI_ACTOR)
            get_runtime().check()
        except RuntimeFailure as exc:
            raise UpstreamError(f"{backend}: {exc}") from exc
        return {"backend": backend, "done": list(done), "state": "ready" if done else "up to date"}

    def describe(self, result: dict) -> str:
        return "\n".join([*result["done"], f"{result['backend']}: {result['state']}"])
