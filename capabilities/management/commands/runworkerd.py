"""Run the local runtime's workerd processes (one per agent) under their watchdog, until
SIGTERM or SIGINT."""

from __future__ import annotations

from django.core.management.base import CommandError

from capabilities.log_sink import local_workerd_group
from capabilities.workerd.host import WorkerdMissing
from sigil.lifetime import supervise_until_signalled
from sigil.owner_commands import SigilCommand


class Command(SigilCommand):
    """Run one workerd per agent serving the loader host on 127.0.0.1 from SIGIL_WORKERD_PORT up;
    stop and restart one that stalls past SIGIL_CPU_MS, grows past SIGIL_WORKERD_MEMORY_MB or dies;
    stop them all on SIGTERM or SIGINT."""

    def handle(self, *args, **options) -> None:
        # In this command's process group, so that whatever stops the group (runsigil, a
        # service manager) stops workerd too, even if this command was killed outright.
        group = local_workerd_group(own_session=False)
        try:
            supervise_until_signalled(group.run, name="workerd-supervisor")
        except WorkerdMissing as exc:
            raise CommandError(str(exc)) from exc
