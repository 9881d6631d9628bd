"""`python manage.py enableagent NAME [--json]`."""

from agents.management.commands._set_active import SetAgentActive


class Command(SetAgentActive):
    """Enable an agent again: its tokens that are neither revoked nor expired work again at once."""

    is_active = True
