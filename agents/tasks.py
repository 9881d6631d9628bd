"""Celery tasks of the agents app: thin wrappers around services."""

from __future__ import annotations

import random

from celery import shared_task
from django.conf import settings

from agents.a2a import A2aUnavailable
from agents.services import WebhookUnavailable


@shared_task(name="agents.agent_webhook_deliver", bind=True, acks_late=True, reject_on_worker_lost=True)
def agent_webhook_deliver(self, *, agent_id: int, delivery: dict, url: str = "") -> None:
    """Deliver (to `url`, else the agent's webhook), retrying with jittered exponential
    backoff while it is unavailable; after the last retry the failure is recorded for the
    owner to see."""
    from agents import services

    try:
        services.agent_webhook_deliver(agent_id=agent_id, delivery=delivery, url=url)
    except WebhookUnavailable as exc:
        if self.request.retries >= settings.SIGIL_WEBHOOK_MAX_RETRIES:
            services.agent_webhook_failed(agent_id=agent_id, delivery=delivery, reason=str(exc))
            return
        countdown = min(600, 2 * 2**self.request.retries) * random.uniform(0.5, 1.0)
        raise self.retry(exc=exc, countdown=countdown, max_retries=None) from exc


@shared_task(name="agents.agent_a2a_deliver", bind=True, acks_late=True, reject_on_worker_lost=True)
def agent_a2a_deliver(self, *, agent_id: int, delivery: dict) -> None:
    """Send an alert as an A2A message, retried as webhooks are (jittered exponential backoff,
    SIGIL_WEBHOOK_MAX_RETRIES); after the last retry the failure is recorded for the owner."""
    from agents import services

    try:
        services.agent_a2a_deliver(agent_id=agent_id, delivery=delivery)
    except A2aUnavailable as exc:
        if self.request.retries >= settings.SIGIL_WEBHOOK_MAX_RETRIES:
            services.agent_a2a_failed(agent_id=agent_id, delivery=delivery, reason=str(exc))
            return
        countdown = min(600, 2 * 2**self.request.retries) * random.uniform(0.5, 1.0)
        raise self.retry(exc=exc, countdown=countdown, max_retries=None) from exc
