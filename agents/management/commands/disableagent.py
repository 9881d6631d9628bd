"""`python manage.py disableagent NAME [--json]`."""

from agents.management.commands._set_active import SetAgentActive


class Command(SetAgentActive):
    """Disable an agent: all of its tokens stop working at once."""

    is_active = False
