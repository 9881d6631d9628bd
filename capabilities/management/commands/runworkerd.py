"""Run workerd with the loader host, restarting it when it dies, until SIGTERM or SIGINT."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from capabilities.workerd import WorkerdHost, WorkerdMissing, supervise_until_signalled


class Command(BaseCommand):
    help = (
        "Run workerd serving the loader host on 127.0.0.1:SIGIL_WORKERD_PORT, restart it when it dies, "
        "and stop it on SIGTERM or SIGINT."
    )

    def handle(self, *args, **options) -> None:
        host = WorkerdHost.from_settings(own_session=False)
        try:
            supervise_until_signalled(host.supervise, name="workerd-supervisor")
        except WorkerdMissing as exc:
            raise CommandError(str(exc)) from exc
