"""Celery tasks: thin wrappers that load by id or name and call the service of the same name."""

from __future__ import annotations

import random

from celery import shared_task
from celery.contrib.django.task import DjangoTask
from celery.exceptions import Retry

from capabilities.runtimes.errors import RuntimeUnavailable

# A retry waits at most this long: the worker holds the retried task, unacknowledged, while
# it waits, and the broker's visibility timeout (settings) must cover the wait and the run.
MAX_COUNTDOWN_SECONDS = 60


def retry_countdown(*, retries: int, retry_after: float | None) -> float:
    """How long before retry number `retries` + 1: the runtime's Retry-After when it gave one
    (Cloudflare's 429), else jittered exponential backoff; at most MAX_COUNTDOWN_SECONDS."""
    if retry_after is not None:
        return min(MAX_COUNTDOWN_SECONDS, retry_after)
    return min(MAX_COUNTDOWN_SECONDS, 2 * 2**retries) * random.uniform(0.5, 1.0)


class RuntimeTask(DjangoTask):
    """A task that talks to the runtime: a transient failure is retried (`retry_countdown`)."""

    max_retries = 8

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except RuntimeUnavailable as exc:
            countdown = retry_countdown(retries=self.request.retries, retry_after=exc.retry_after)
            raise self.retry(exc=exc, countdown=countdown) from exc


RETRY_TRANSIENT = {"base": RuntimeTask}


# Sent to the deploy queue. Its outcome is recorded on the version and handed to the waiting
# request by the service, so no result backend is needed. A transient failure is retried
# (the service says when, and keeps the version owned meanwhile); the last try records it.
@shared_task(name="capabilities.capability_place_version", bind=True, acks_late=True, reject_on_worker_lost=True)
def capability_place_version(self, *, version_id: int) -> None:
    from django.conf import settings

    from capabilities import services

    retries = settings.SIGIL_DEPLOY_RETRIES
    try:
        services.capability_place_version(version_id=version_id, retries=self.request.retries, max_retries=retries)
    except RuntimeUnavailable as exc:
        raise self.retry(exc=exc, countdown=exc.retry_after, max_retries=retries) from exc


@shared_task(name="capabilities.capability_release_slot", acks_late=True, reject_on_worker_lost=True, **RETRY_TRANSIENT)
def capability_release_slot(*, capability_id: int) -> None:
    from capabilities import services

    services.capability_release_slot(capability_id=capability_id)


@shared_task(name="capabilities.capability_clear_slot", acks_late=True, reject_on_worker_lost=True, **RETRY_TRANSIENT)
def capability_clear_slot(*, full: str, slot: str) -> None:
    from capabilities import services

    services.capability_clear_slot(full=full, slot=slot)


@shared_task(name="capabilities.capability_expire_ephemerals", acks_late=True, reject_on_worker_lost=True)
def capability_expire_ephemerals() -> None:
    from capabilities import services

    services.capability_expire_ephemerals()


@shared_task(name="capabilities.capability_flush_stats", acks_late=True, reject_on_worker_lost=True)
def capability_flush_stats() -> None:
    from capabilities import services

    services.capability_flush_stats()


@shared_task(name="capabilities.capability_split_guard", acks_late=True, reject_on_worker_lost=True)
def capability_split_guard() -> None:
    from capabilities import services

    services.capability_split_guard()


@shared_task(name="capabilities.capability_record_breaker", acks_late=True, reject_on_worker_lost=True)
def capability_record_breaker(*, full: str, state: str, at_epoch: float) -> None:
    from capabilities import services

    services.capability_record_breaker(full=full, state=state, at_epoch=at_epoch)


# How often a page-out checks again whether its victim's calls in flight have ended.
PAGE_OUT_RECHECK_SECONDS = 0.25


@shared_task(
    name="capabilities.capability_page_out", bind=True, acks_late=True, reject_on_worker_lost=True, **RETRY_TRANSIENT
)
def capability_page_out(self, *, full: str, wait_until: float | None = None) -> None:
    """Two budgets: the wait for calls in flight is bounded in time (the service sets the
    deadline on its first check), runtime failures by RuntimeTask's retries, which the
    waiting does not use up."""
    from capabilities import services

    try:
        services.capability_page_out(full=full, wait_until=wait_until)
    except services.StillInFlight as exc:
        # The same task again, keeping its deadline and its retry count (self.retry() would
        # add one to the count).
        again = self.signature_from_request(
            kwargs={"full": full, "wait_until": exc.wait_until},
            countdown=PAGE_OUT_RECHECK_SECONDS,
            retries=self.request.retries,
        )
        again.apply_async()
        raise Retry(exc=exc, when=PAGE_OUT_RECHECK_SECONDS, sig=again) from exc


@shared_task(name="capabilities.capability_reconcile", acks_late=True, reject_on_worker_lost=True)
def capability_reconcile() -> None:
    from capabilities import services

    services.capability_reconcile()


@shared_task(name="capabilities.capability_reap", acks_late=True, reject_on_worker_lost=True)
def capability_reap() -> None:
    from capabilities import services

    services.capability_reap()


@shared_task(name="capabilities.capability_mark_inactive", acks_late=True, reject_on_worker_lost=True)
def capability_mark_inactive() -> None:
    from capabilities import services

    services.capability_mark_inactive()


@shared_task(name="capabilities.capability_prewarm", acks_late=True, reject_on_worker_lost=True, **RETRY_TRANSIENT)
def capability_prewarm() -> None:
    from capabilities import services

    services.capability_prewarm()


@shared_task(name="capabilities.capability_prune_stats", acks_late=True, reject_on_worker_lost=True)
def capability_prune_stats() -> None:
    from capabilities import services

    services.capability_prune_stats()


@shared_task(
    name="capabilities.capability_refresh_bindings", acks_late=True, reject_on_worker_lost=True, **RETRY_TRANSIENT
)
def capability_refresh_bindings(*, full: str) -> None:
    from capabilities import services

    services.capability_refresh_bindings(full=full)


@shared_task(name="capabilities.call_records_collect", acks_late=True, reject_on_worker_lost=True)
def call_records_collect() -> None:
    # No retry: the next beat comes within SIGIL_LOGS_COLLECT_INTERVAL_SECONDS, and a batch
    # not yet taken waits for it where the tail left it.
    from capabilities import call_logs
    from capabilities.runtimes import get_runtime

    call_logs.call_records_collect(runtime=get_runtime())
