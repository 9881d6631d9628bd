"""Celery tasks: thin wrappers that load by id or name and call the service of the same name."""

from __future__ import annotations

from celery import shared_task

from capabilities.runtimes.base import RuntimeUnavailable

RETRY_TRANSIENT = {
    "autoretry_for": (RuntimeUnavailable,),
    "retry_backoff": 2,
    "retry_backoff_max": 300,
    "retry_jitter": True,
    "retry_kwargs": {"max_retries": 8},
}


@shared_task(name="capabilities.capability_release_slot", acks_late=True, reject_on_worker_lost=True, **RETRY_TRANSIENT)
def capability_release_slot(*, capability_id: int) -> None:
    from capabilities import services

    services.capability_release_slot(capability_id=capability_id)


@shared_task(name="capabilities.capability_expire_ephemerals", acks_late=True, reject_on_worker_lost=True)
def capability_expire_ephemerals() -> None:
    from capabilities import services

    services.capability_expire_ephemerals()


@shared_task(name="capabilities.capability_flush_stats", acks_late=True, reject_on_worker_lost=True)
def capability_flush_stats() -> None:
    from capabilities import services

    services.capability_flush_stats()


@shared_task(name="capabilities.capability_record_breaker", acks_late=True, reject_on_worker_lost=True)
def capability_record_breaker(*, full: str, state: str, at_epoch: float) -> None:
    from capabilities import services

    services.capability_record_breaker(full=full, state=state, at_epoch=at_epoch)


@shared_task(
    name="capabilities.capability_page_out", bind=True, acks_late=True, reject_on_worker_lost=True, **RETRY_TRANSIENT
)
def capability_page_out(self, *, full: str) -> None:
    from capabilities import services

    try:
        services.capability_page_out(full=full, attempt=self.request.retries)
    except services.StillInFlight as exc:
        raise self.retry(exc=exc, countdown=0.2, max_retries=services.PAGE_OUT_INFLIGHT_CHECKS + 8) from exc


@shared_task(name="capabilities.capability_page_in", acks_late=True, reject_on_worker_lost=True, **RETRY_TRANSIENT)
def capability_page_in(*, full: str) -> None:
    from capabilities import services

    services.capability_page_in(full=full)


@shared_task(name="capabilities.capability_reconcile", acks_late=True, reject_on_worker_lost=True)
def capability_reconcile() -> None:
    from capabilities import services

    services.capability_reconcile()
