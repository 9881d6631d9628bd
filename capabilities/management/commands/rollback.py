"""`python manage.py rollback AGENT--NAME VERSION [--json]`."""

from capabilities import services
from capabilities.selectors import capability_get
from sigil.owner_commands import CAPABILITY, CLI_ACTOR, OwnerCommand, argument


class Command(OwnerCommand):
    """Serve an earlier version's code again, as a new version numbered after the latest
    (bindings and the public flag stay as they are)."""

    arguments = (CAPABILITY, argument("version", type=int, help="the version whose code to serve"))

    def act(self, *, capability: str, version: int, **options) -> dict:
        current = capability_get(full=capability)
        previous = current.current_version.number if current.current_version else None
        result = services.capability_rollback(capability=current, version_number=version, actor=CLI_ACTOR)
        return {
            "capability": capability,
            "restored": version,
            "version": result.version.number,
            "changed": result.version.number != previous,
            # On the Cloudflare runtimes the deploy task places it; it may still be under way.
            "placing": result.pending,
        }

    def describe(self, result: dict) -> str:
        if not result["changed"]:
            return f"{result['capability']} already serves the code of version {result['restored']}"
        if result["placing"]:
            return (
                f"{result['capability']}: version {result['version']}, with the code of version {result['restored']}, "
                f"is being placed (see `/_status/{result['capability']}`)"
            )
        return f"{result['capability']}: version {result['version']} serves the code of version {result['restored']}"
