"""The task policy and the queues, each declared once: every task Sigil runs is acknowledged
late and given back when its worker is lost, every job a service sends names a task that
exists, and CELERY_TASK_ROUTES sends each task to its queue, read as it is sent."""

import pytest

from agents import jobs as agent_jobs
from capabilities import jobs as capability_jobs
from sigil.work import Job
from sigil_site.celery import app


@pytest.fixture(scope="module")
def sigil_tasks():
    app.loader.import_default_modules()
    return {name: task for name, task in app.tasks.items() if name.startswith(("agents.", "capabilities."))}


def test_every_task_is_acknowledged_late_and_given_back_when_its_worker_is_lost(sigil_tasks):
    assert {"capabilities.capability_place_version", "agents.agent_callback_deliver"} <= set(sigil_tasks)
    loose = [name for name, task in sigil_tasks.items() if not (task.acks_late and task.reject_on_worker_lost)]
    assert loose == []


def test_every_job_names_a_task_and_every_task_has_its_job(sigil_tasks):
    named = {v.name for module in (agent_jobs, capability_jobs) for v in vars(module).values() if isinstance(v, Job)}
    assert named == set(sigil_tasks)


def queue_of(name: str) -> str:
    return app.amqp.router.route({}, name)["queue"].name


def test_each_task_goes_to_the_queue_its_setting_names_when_it_is_sent(settings):
    assert queue_of("capabilities.capability_place_version") == "deploys"
    assert queue_of("agents.agent_callback_deliver") == settings.SIGIL_ASYNC_QUEUE == "celery"
    assert queue_of("capabilities.capability_page_out") == "celery"
    assert queue_of("agents.agent_webhook_deliver") == "celery"

    settings.SIGIL_DEPLOY_QUEUE = "deploys-elsewhere"
    settings.SIGIL_ASYNC_QUEUE = "callbacks"
    assert queue_of("capabilities.capability_place_version") == "deploys-elsewhere"
    assert queue_of("agents.agent_callback_deliver") == "callbacks"
    assert queue_of("agents.agent_webhook_deliver") == "celery"


def test_every_capabilities_task_names_the_class_of_its_api_work(sigil_tasks):
    from capabilities.tasks import API_CLASS_OF_TASK, CapabilityTask

    mine = {name: task for name, task in sigil_tasks.items() if name.startswith("capabilities.")}
    assert {job.name for job in API_CLASS_OF_TASK} == set(mine)
    assert all(isinstance(task, CapabilityTask) for task in mine.values())
