"""The Celery app: settings under the CELERY_ namespace, tasks autodiscovered from tasks.py."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sigil_site.settings")

app = Celery("sigil", task_cls="celery.contrib.django.task:DjangoTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
