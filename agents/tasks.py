"""Celery tasks of the agents app: thin wrappers around services."""

from __future__ import annotations

from celery import shared_task

from agents.services import WebhookUnavailable


@shared_task(
    name="agents.agent_webhook_deliver",
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(WebhookUnavailable,),
    retry_backoff=2,
    retry_backoff_max=600,
    retry_jitter=True,
    retry_kwargs={"max_retries": 8},
)
def agent_webhook_deliver(*, agent_id: int, delivery: dict) -> None:
    from agents import services

    services.agent_webhook_deliver(agent_id=agent_id, delivery=delivery)
