"""Run workerd with the loader host, restarting it when it dies, until SIGTERM or SIGINT."""

from __future__ import annotations

import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from capabilities.workerd import WorkerdHost, WorkerdMissing


class Command(BaseCommand):
    help = (
        "Run workerd serving the loader host on 127.0.0.1:SIGIL_WORKERD_PORT, restart it when it dies, "
        "and stop it on SIGTERM or SIGINT."
    )

    def handle(self, *args, **options) -> None:
        host = WorkerdHost(
            binary=settings.SIGIL_WORKERD_BIN,
            port=settings.SIGIL_WORKERD_PORT,
            code_dir=settings.SIGIL_CODE_DIR,
            state_dir=settings.VAR_DIR / "workerd",
            secret=settings.SIGIL_INTERNAL_SECRET,
            own_session=False,
        )
        stop = threading.Event()
        failure: list[BaseException] = []

        def supervise() -> None:
            try:
                host.supervise(stop)
            except BaseException as exc:  # handed to the main thread, which reports it
                failure.append(exc)

        # Supervision runs in its own thread so that the signal handlers, which run on the
        # main thread, never wait on a lock that thread holds.
        thread = threading.Thread(target=supervise, name="workerd-supervisor")
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
        if failure:
            if isinstance(failure[0], WorkerdMissing):
                raise CommandError(str(failure[0]))
            raise failure[0]
