"""The agents app's background jobs by name (sigil.work.Job): services send these, and
agents/tasks.py declares the tasks that run them."""

from sigil.work import Job

agent_webhook_deliver = Job("agents.agent_webhook_deliver")
# A call's result to the callback URL its caller named: a task of its own, so that
# CELERY_TASK_ROUTES can send it to SIGIL_ASYNC_QUEUE, apart from the agents' alerts.
agent_callback_deliver = Job("agents.agent_callback_deliver")
agent_a2a_deliver = Job("agents.agent_a2a_deliver")
