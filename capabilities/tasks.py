"""Celery tasks: thin wrappers that call the service of the same name with the task's
arguments (ids and names, never rows).

Each is declared with sigil.work.task (the one policy: late acknowledgement, given back when
its worker is lost) for a job of capabilities/jobs.py, which is what the services send; the
queue each goes to is CELERY_TASK_ROUTES' (settings).
"""

from __future__ import annotations

import logging
import random

from celery.contrib.django.task import DjangoTask
from celery.exceptions import Retry
from django.conf import settings

from capabilities import jobs, services
from capabilities.jobs import PAGE_OUT_RECHECK_SECONDS
from capabilities.runtimes.api_work import ApiClass, api_work
from capabilities.runtimes.errors import RuntimeThrottled, RuntimeUnavailable
from sigil.work import MAX_COUNTDOWN_SECONDS, Job, retry_countdown, task

logger = logging.getLogger(__name__)

# The class of API work each task does (capabilities/runtimes/api_work.py): what the runtime's
# API budget serves first. Every task of this module is here (a test holds it so).
API_CLASS_OF_TASK = {
    jobs.capability_place_version: ApiClass.DEPLOY,
    # A binding's new value (a rotated secret) placed again: the owner's change, as a deploy.
    jobs.capability_refresh_bindings: ApiClass.DEPLOY,
    jobs.capability_page_out: ApiClass.PAGE_OUT,
    jobs.capability_release_slot: ApiClass.PAGE_OUT,
    jobs.capability_clear_slot: ApiClass.PAGE_OUT,
    jobs.capability_reconcile: ApiClass.HOUSEKEEPING,
    jobs.capability_prewarm: ApiClass.HOUSEKEEPING,
    jobs.capability_expire_ephemerals: ApiClass.HOUSEKEEPING,
    jobs.capability_flush_stats: ApiClass.HOUSEKEEPING,
    jobs.capability_prune_stats: ApiClass.HOUSEKEEPING,
    jobs.capability_split_guard: ApiClass.HOUSEKEEPING,
    jobs.capability_record_breaker: ApiClass.HOUSEKEEPING,
    jobs.capability_reap: ApiClass.HOUSEKEEPING,
    jobs.capability_mark_inactive: ApiClass.HOUSEKEEPING,
    # What the edge decides by (a revocation, a forced breaker, a deploy's route) waits on this
    # publish, which coalesces every change of its interval into one request: someone's change.
    jobs.edge_publish: ApiClass.DEPLOY,
    jobs.edge_reconcile: ApiClass.HOUSEKEEPING,
}
_CLASS_BY_NAME = {job.name: api_class for job, api_class in API_CLASS_OF_TASK.items()}


class CapabilityTask(DjangoTask):
    """A task of this module: its API calls are its class's (API_CLASS_OF_TASK). Housekeeping
    that finds no room in the runtime's API budget is skipped, not retried: its next beat runs
    it again, and a retry would only wait for room the work above it needs."""

    def __call__(self, *args, **kwargs):
        api_class = _CLASS_BY_NAME[self.name]
        with api_work(api_class):
            try:
                return super().__call__(*args, **kwargs)
            except RuntimeThrottled as exc:
                if api_class.waits:
                    raise
                logger.info("%s skipped until its next run: %s", self.name, exc.why or exc)
                return None


class RuntimeTask(CapabilityTask):
    """A task that talks to the runtime: a transient failure is retried (`retry_countdown`); a
    spent API budget when it has room for this task's class again (its `retry_after`, spread a
    little so that the tasks it held back do not take the room back all at once), as far as a
    countdown may reach (MAX_COUNTDOWN_SECONDS): never sooner."""

    max_retries = 8

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except RuntimeThrottled as exc:
            countdown = retry_countdown(retries=self.request.retries, retry_after=exc.retry_after)
            if exc.retry_after is not None:
                countdown = min(MAX_COUNTDOWN_SECONDS, countdown + random.uniform(0, min(5.0, countdown / 10)))
            raise self.retry(exc=exc, countdown=countdown) from exc
        except RuntimeUnavailable as exc:
            countdown = retry_countdown(retries=self.request.retries, retry_after=exc.retry_after)
            raise self.retry(exc=exc, countdown=countdown) from exc


def service_task(job: Job, **options):
    """The task of `job` that calls the service of the same name (`capabilities.services`),
    passing its keyword arguments on; `options` as for sigil.work.task (its base by default
    CapabilityTask)."""
    options.setdefault("base", CapabilityTask)
    service = job.name.rpartition(".")[2]

    def run(**kwargs) -> None:
        getattr(services, service)(**kwargs)

    run.__name__ = run.__qualname__ = service
    return task(job, **options)(run)


capability_release_slot = service_task(jobs.capability_release_slot, base=RuntimeTask)
capability_clear_slot = service_task(jobs.capability_clear_slot, base=RuntimeTask)
capability_prewarm = service_task(jobs.capability_prewarm, base=RuntimeTask)
capability_refresh_bindings = service_task(jobs.capability_refresh_bindings, base=RuntimeTask)
capability_expire_ephemerals = service_task(jobs.capability_expire_ephemerals)
capability_flush_stats = service_task(jobs.capability_flush_stats)
capability_split_guard = service_task(jobs.capability_split_guard)
capability_record_breaker = service_task(jobs.capability_record_breaker)
capability_reconcile = service_task(jobs.capability_reconcile)
capability_reap = service_task(jobs.capability_reap)
capability_mark_inactive = service_task(jobs.capability_mark_inactive)
capability_prune_stats = service_task(jobs.capability_prune_stats)
# No retry: the publisher gives its keys back when Cloudflare fails, and beat runs it again
# within SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS; the reconcile's next run is as good as a retry.
edge_publish = service_task(jobs.edge_publish)
edge_reconcile = service_task(jobs.edge_reconcile)


# Its outcome is recorded on the version and handed to the waiting request by the service, so
# no result backend is needed. A transient failure is retried (the service says when, and
# keeps the version owned meanwhile); the last try records it.
@task(jobs.capability_place_version, bind=True, base=CapabilityTask)
def capability_place_version(self, *, version_id: int) -> None:
    retries = settings.SIGIL_DEPLOY_RETRIES
    try:
        services.capability_place_version(version_id=version_id, retries=self.request.retries, max_retries=retries)
    except RuntimeUnavailable as exc:
        raise self.retry(exc=exc, countdown=exc.retry_after, max_retries=retries) from exc


@task(jobs.capability_page_out, bind=True, base=RuntimeTask)
def capability_page_out(self, *, full: str, wait_until: float | None = None) -> None:
    """Two budgets: the wait for calls in flight is bounded in time (the service sets the
    deadline on its first check), runtime failures by RuntimeTask's retries, which the
    waiting does not use up."""
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
