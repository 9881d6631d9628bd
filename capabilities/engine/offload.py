"""The bounded pool of threads in which the engine runs what blocks: the ORM on the cold path,
a placement, the Cloudflare client, a Celery enqueue. Never the event loop.

Each job runs in a copy of its caller's context, so what travels with the work in context
variables (the class of its API calls, capabilities/runtimes/api_work.py) reaches the thread."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import close_old_connections


class Offload:
    """The pool; each job closes the database connections Django would close after a request
    (CONN_MAX_AGE), as no Django handler runs here."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sigil-offload")

    async def __call__(self, function: Callable, /, *args, **kwargs) -> Any:
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.pool, context.run, _job, function, args, kwargs)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _job(function: Callable, args: tuple, kwargs: dict) -> Any:
    close_old_connections()
    try:
        return function(*args, **kwargs)
    finally:
        close_old_connections()
