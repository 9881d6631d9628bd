"""What `disableagent` and `enableagent` share (not a command itself: its name starts with _)."""

from agents import services
from agents.selectors import agent_named
from sigil.owner_commands import CLI_ACTOR, OwnerCommand, argument


class SetAgentActive(OwnerCommand):
    is_active: bool
    arguments = (argument("agent"),)

    def act(self, *, agent: str, **options) -> dict:
        changed = services.agent_set_active(agent=agent_named(agent), is_active=self.is_active, actor=CLI_ACTOR)
        return {"agent": agent, "active": self.is_active, "changed": changed}

    def describe(self, result: dict) -> str:
        done = "enabled" if self.is_active else "disabled"
        return f"{result['agent']} {done}" if result["changed"] else f"{result['agent']} was already {done}"
