"""The Celery app: settings under the CELERY_ namespace, tasks autodiscovered from tasks.py."""

import logging
import os
import time

from celery import Celery
from celery.signals import setup_logging, task_failure, task_postrun, task_prerun, task_success, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sigil_site.settings")
# Warnings (Celery's about running as root) become log records in Sigil's format too.
logging.captureWarnings(True)

app = Celery("sigil", task_cls="celery.contrib.django.task:DjangoTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


# Celery logs through Sigil's own configuration (one format for every process, see
# sigil/logs.py) instead of replacing the root logger's handlers with its own.
@setup_logging.connect
def _sigil_logging(**kwargs) -> None:
    import logging.config

    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
    logging.captureWarnings(True)


# A task's log lines carry its id as their request id (the id its failure is logged under).
@task_prerun.connect
def _name_task_lines(task_id=None, **kwargs) -> None:
    from sigil.request_id import set_request_id

    set_request_id(task_id)


@task_postrun.connect
def _end_task_lines(**kwargs) -> None:
    from sigil.request_id import set_request_id

    set_request_id(None)


# Wiring only: the owner's beat schedule page shows when each periodic task last ran.
@task_success.connect
def _remember_success(sender=None, **kwargs) -> None:
    from sigil_site.beat import beat_record_run

    beat_record_run(task=sender.name, ok=True, at_epoch=time.time())


@task_failure.connect
def _remember_failure(sender=None, task_id=None, exception=None, **kwargs) -> None:
    from sigil.errors import SigilError, error_for_unexpected
    from sigil_site.beat import beat_record_run

    # In the contract's terms. An unexpected error's request id is the task id, which
    # Celery's own log line of the traceback names too ("Task name[id] raised unexpected").
    error = exception if isinstance(exception, SigilError) else error_for_unexpected(exception, request_id=task_id)
    beat_record_run(task=sender.name, ok=False, at_epoch=time.time(), error=f"{error.code}: {error.message}")


# A Celery worker places capabilities: it makes Sigil's own Worker ready as it starts, as the
# web process does (sigil_site/asgi.py), so a worker alone is enough on a fresh account.
@worker_ready.connect
def _runtime_ready(sender=None, **kwargs) -> None:
    from capabilities.services import runtime_ready

    runtime_ready(actor="system")
