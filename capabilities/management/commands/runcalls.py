"""`manage.py runcalls`: a process that only runs accepted asynchronous calls, the runners every
web process also runs (capabilities/engine/runner.py); for hosts that keep agents' async calls
apart from the web servers."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from django.core.management.base import BaseCommand

from capabilities.engine.engine import Engine
from capabilities.engine.runner import AsyncCallRunner


class Command(BaseCommand):
    help = "Run accepted asynchronous calls until SIGTERM or Ctrl-C."

    def handle(self, *args, **options) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        engines: list[Engine] = []

        def engine_of() -> Engine:
            if not engines:
                engines.append(Engine())
            return engines[0]

        runner = AsyncCallRunner(engine_of)
        task = asyncio.create_task(runner.run())
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, task.cancel)
        self.stdout.write(f"running asynchronous calls as {runner.runner_id}")
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for engine in engines:
            await engine.aclose()
