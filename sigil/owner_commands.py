"""What Sigil's shell commands share: help written as the class's docstring, arguments declared
as data; and for the owner's commands, `--json` output and Sigil's errors as the command's
error. Each command calls one service and prints what it returned."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from sigil.errors import SigilError

#: the actor the audit trail records for what the owner does from a shell
CLI_ACTOR = "owner:cli"

#: one argument of a command: the names and the keywords `parser.add_argument` takes
Argument = tuple[tuple[str, ...], dict[str, Any]]


def argument(*names: str, **options: Any) -> Argument:
    """One argument, as `parser.add_argument(*names, **options)` would declare it."""
    return names, options


#: a capability named by its full name, AGENT--NAME (the option `capability`)
CAPABILITY = argument("capability", help="its full name, agent--name")


class SigilCommand(BaseCommand):
    """A command whose help is its class's docstring (as one line: argparse wraps it anyway) and
    whose arguments are `arguments`, in that order."""

    arguments: tuple[Argument, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__ != __name__ and cls.__doc__ and "help" not in cls.__dict__:
            cls.help = " ".join(cls.__doc__.split())

    def add_arguments(self, parser: CommandParser) -> None:
        for names, options in self.arguments:
            parser.add_argument(*names, **options)


class OwnerCommand(SigilCommand):
    """Subclasses implement `act` (returns a JSON-able result) and `describe` (its text), and
    `refusal` when a result, once printed, still means the command failed (exit status 1)."""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the result as JSON")
        super().add_arguments(parser)

    def handle(self, *args, as_json: bool = False, **options) -> None:
        try:
            result = self.act(**options)
        except SigilError as exc:
            raise CommandError(exc.message) from exc
        if as_json:
            self.stdout.write(json.dumps(result, default=_json_default))
        else:
            self.stdout.write(self.describe(result))
        refusal = self.refusal(result)
        if refusal:
            raise CommandError(refusal)

    def act(self, **options):
        raise NotImplementedError

    def refusal(self, result) -> str | None:
        """Why the command fails though it printed `result`; None when it succeeded."""
        return None

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
