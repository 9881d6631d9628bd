"""`python manage.py edgestate [--json]`."""

from dataclasses import asdict
from datetime import UTC, datetime

from capabilities import services
from sigil.owner_commands import OwnerCommand


class Command(OwnerCommand):
    """Show the publisher of the edge's state: keys waiting to be written to Workers KV, its last publish
    and its last failure."""

    def act(self, **options) -> dict:
        standing = asdict(services.edge_standing())
        for name in ("published_at", "failed_at"):
            if standing[name] is not None:
                standing[name] = datetime.fromtimestamp(standing[name], tz=UTC).isoformat(timespec="seconds")
        return standing

    def describe(self, result: dict) -> str:
        lines = [] if result["edge_on"] else ["the edge is off (SIGIL_EDGE): nothing is published"]
        lines.append(f"keys waiting to be published: {result['waiting']}")
        published = result["published_at"]
        lines.append(f"last published: {published}, {result['published']} keys" if published else "never published")
        if result["failures_in_a_row"]:
            lines.append(f"failed {result['failures_in_a_row']} times in a row, last at {result['failed_at']}:")
            lines.append(f"  {result['error']}")
        elif result["failed_at"]:
            lines.append(f"last failure, since published: {result['failed_at']}: {result['error']}")
        return "\n".join(lines)
