"""What the owner's shell commands share: `--json` output, and Sigil's errors as the
command's error. Each command calls one service and prints what it returned."""

from __future__ import annotations

import json
from datetime import datetime

from django.core.management.base import BaseCommand, CommandError, CommandParser

from sigil.errors import SigilError

#: the actor the audit trail records for what the owner does from a shell
CLI_ACTOR = "owner:cli"


class OwnerCommand(BaseCommand):
    """Subclasses implement `act` (returns a JSON-able result) and `describe` (its text)."""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the result as JSON")

    def handle(self, *args, as_json: bool = False, **options) -> None:
        try:
            result = self.act(**options)
        except SigilError as exc:
            raise CommandError(exc.message) from exc
        if as_json:
            self.stdout.write(json.dumps(result, default=_json_default))
        else:
            self.stdout.write(self.describe(result))

    def act(self, **options):
        raise NotImplementedError

    def describe(self, result) -> str:
        raise NotImplementedError


def _json_default(value):
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def table(rows: list[dict], columns: list[str]) -> str:
    """Rows as aligned text columns, for a terminal."""
    if not rows:
        return "(none)"
    cells = [[str(row.get(c, "") if row.get(c) is not None else "-") for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)
