"""Background work: the one policy every Celery task is declared with, and the jobs that name
the tasks, so that whoever sends one does not import the task's module (which imports the
services that send it: a circle).

Queues are not chosen here nor by senders: CELERY_TASK_ROUTES (settings) routes each task by
its name.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from celery import current_app, shared_task
from django.db import transaction

# Every task is acknowledged only once it has run, and given back to the broker when its
# worker is lost mid-run: work a killed worker held runs again elsewhere (so every task can run
# twice, and is idempotent).
POLICY = {"acks_late": True, "reject_on_worker_lost": True}

# A retry waits at most this long by default: the worker holds the retried task,
# unacknowledged, while it waits, and the broker's visibility timeout (settings) must cover the
# wait and the run.
MAX_COUNTDOWN_SECONDS = 60


@dataclass(frozen=True)
class Job:
    """A task by its name: what a sender holds. Sent by name (Celery's send_task), routed by
    CELERY_TASK_ROUTES; the task itself is declared with `task(job)`."""

    name: str

    def delay(self, **kwargs) -> None:
        """Send the task now."""
        current_app.send_task(self.name, kwargs=kwargs)

    def delay_on_commit(self, **kwargs) -> None:
        """Send the task once the current transaction commits (at once outside one)."""
        transaction.on_commit(functools.partial(self.delay, **kwargs))


def task(job: Job, **options):
    """Declare the Celery task that runs `job`, with POLICY and `options` (bind, base, ...)."""
    return shared_task(name=job.name, **POLICY, **options)


def retry_countdown(*, retries: int, retry_after: float | None = None, most: float = MAX_COUNTDOWN_SECONDS) -> float:
    """How long before retry number `retries` + 1: `retry_after` when the other side gave one
    (Cloudflare's 429), else jittered exponential backoff; at most `most` seconds."""
    if retry_after is not None:
        return min(most, retry_after)
    return min(most, 2 * 2**retries) * random.uniform(0.5, 1.0)
