"""`python manage.py createagent NAME [--json]`: an agent with one deploy and one invoke token."""

import json

from django.core.management.base import BaseCommand, CommandError

from agents import services
from sigil.errors import SigilError


class Command(BaseCommand):
    help = "Create an agent with a deploy token and an invoke token (shown once)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("name")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the result as one JSON object")

    def handle(self, *args, name: str, as_json: bool = False, **options) -> None:
        try:
            created = services.agent_create_with_tokens(name=name, actor="owner:cli", label="createagent")
        except SigilError as exc:
            raise CommandError(exc.message) from exc
        agent, (_, deploy), (_, invoke) = created.agent, created.deploy, created.invoke
        result = {"agent": agent.name, "deploy_token": deploy, "invoke_token": invoke}
        if as_json:
            self.stdout.write(json.dumps(result))
        else:
            self.stdout.write(f"Agent {agent.name} created. These tokens are shown once:")
            self.stdout.write(f"  deploy: {deploy}")
            self.stdout.write(f"  invoke: {invoke}")
