"""Celery tasks of the agents app: thin wrappers around services, declared with sigil.work.task
for the jobs of agents/jobs.py."""

from __future__ import annotations

import functools
from collections.abc import Callable

from celery import Task
from django.conf import settings

from agents import jobs, services
from agents.a2a import A2aUnavailable
from sigil.work import retry_countdown, task

# The longest wait between two tries of one delivery.
MAX_DELIVERY_COUNTDOWN_SECONDS = 600


def _deliver(self: Task, send: Callable[[], None], failed: Callable[[str], None], unavailable: type[Exception]) -> None:
    """Run `send`, retrying with jittered exponential backoff while it raises `unavailable`,
    SIGIL_WEBHOOK_MAX_RETRIES times; after the last, `failed` records why for the owner to see."""
    try:
        send()
    except unavailable as exc:
        if self.request.retries >= settings.SIGIL_WEBHOOK_MAX_RETRIES:
            failed(str(exc))
            return
        countdown = retry_countdown(retries=self.request.retries, most=MAX_DELIVERY_COUNTDOWN_SECONDS)
        raise self.retry(exc=exc, countdown=countdown, max_retries=None) from exc


def _webhook_deliver(self: Task, *, agent_id: int, delivery: dict, url: str = "") -> None:
    """Deliver (to `url`, else the agent's webhook), retried while it is unavailable; after
    the last retry the failure is recorded for the owner to see."""
    _deliver(
        self,
        functools.partial(services.agent_webhook_deliver, agent_id=agent_id, delivery=delivery, url=url),
        lambda reason: services.agent_delivery_failed(agent_id=agent_id, delivery=delivery, reason=reason),
        services.WebhookUnavailable,
    )


agent_webhook_deliver = task(jobs.agent_webhook_deliver, bind=True)(_webhook_deliver)
# A call's result to its callback URL: the same delivery, on SIGIL_ASYNC_QUEUE (CELERY_TASK_ROUTES).
agent_callback_deliver = task(jobs.agent_callback_deliver, bind=True)(_webhook_deliver)


@task(jobs.agent_a2a_deliver, bind=True)
def agent_a2a_deliver(self: Task, *, agent_id: int, delivery: dict) -> None:
    """Send an alert as an A2A message, retried as webhooks are; after the last retry the
    failure is recorded for the owner."""
    _deliver(
        self,
        functools.partial(services.agent_a2a_deliver, agent_id=agent_id, delivery=delivery),
        lambda reason: services.agent_delivery_failed(
            agent_id=agent_id, delivery=delivery, reason=reason, channel="a2a"
        ),
        A2aUnavailable,
    )
