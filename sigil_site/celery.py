"""The Celery app: settings under the CELERY_ namespace, tasks autodiscovered from tasks.py."""

import os
import time

from celery import Celery
from celery.signals import task_failure, task_success, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sigil_site.settings")

app = Celery("sigil", task_cls="celery.contrib.django.task:DjangoTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


# Wiring only: the owner's beat schedule page shows when each periodic task last ran.
@task_success.connect
def _remember_success(sender=None, **kwargs) -> None:
    from sigil_site.beat import beat_record_run

    beat_record_run(task=sender.name, ok=True, at_epoch=time.time())


@task_failure.connect
def _remember_failure(sender=None, task_id=None, exception=None, **kwargs) -> None:
    from sigil_site.beat import beat_record_run
    from sigil_site.errors import SigilError, error_for_unexpected

    # In the contract's terms. An unexpected error's request id is the task id, which
    # Celery's own log line of the traceback names too ("Task name[id] raised unexpected").
    error = exception if isinstance(exception, SigilError) else error_for_unexpected(exception, request_id=task_id)
    beat_record_run(task=sender.name, ok=False, at_epoch=time.time(), error=f"{error.code}: {error.message}")


# A Celery worker places capabilities: it makes Sigil's own Worker ready as it starts, as the
# web process does (sigil_site/wsgi.py), so a worker alone is enough on a fresh account.
@worker_ready.connect
def _runtime_ready(sender=None, **kwargs) -> None:
    from capabilities.services import runtime_ready

    runtime_ready(actor="system")
