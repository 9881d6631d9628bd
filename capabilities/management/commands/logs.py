"""`python manage.py logs AGENT--NAME [--request-id ID] [--level LEVEL] [--limit N] [--follow] [--json]`."""

from __future__ import annotations

import contextlib
import json
import time
from datetime import UTC, datetime

from django.conf import settings

from capabilities.books import call_logs
from capabilities.selectors import capability_get
from sigil.owner_commands import OwnerCommand, argument


class Command(OwnerCommand):
    """Print a capability's latest call records (console lines, uncaught exception, outcome),
    oldest of them first; with --follow, then every new one as it is kept, until Ctrl-C."""

    arguments = (
        argument("full", metavar="AGENT--NAME"),
        argument("--request-id", help="only the call with this X-Request-Id"),
        argument("--level", choices=call_logs.LEVELS, help="only calls with a line at this level or above"),
        argument("--limit", type=int, default=20, help="how many of the latest (20)"),
        argument("--follow", action="store_true", help="then print new records as they are kept"),
        argument("--for", type=float, dest="for_seconds", help="with --follow: stop after this many seconds"),
    )

    def act(
        self,
        *,
        full: str,
        request_id: str | None,
        level: str | None,
        limit: int,
        follow: bool,
        for_seconds: float | None = None,
        **options,
    ):
        capability = capability_get(full=full)
        page = call_logs.call_records_list(
            full=capability.full_name,
            query=call_logs.RecordQuery(request_id=request_id, level=level, limit=max(1, limit)),
        )
        records = list(reversed(page.records))
        if not follow:
            return records
        as_json = options.get("as_json")
        for record in records:
            self._print(record, as_json=as_json)
        after = records[-1]["seq"] if records else call_logs.call_records_newest_seq(full=capability.full_name)
        deadline = None if for_seconds is None else time.monotonic() + for_seconds
        # Until interrupted (or --for): each pass lasts at most the longest a tail may.
        while deadline is None or time.monotonic() < deadline:
            seconds = settings.SIGIL_LOGS_TAIL_SECONDS if deadline is None else deadline - time.monotonic()
            for record in call_logs.call_records_follow(full=capability.full_name, after=after, seconds=seconds):
                if record is None or (request_id and record["request_id"] != request_id):
                    continue
                if level and not call_logs.record_reaches(record, level):
                    continue
                after = record["seq"]
                self._print(record, as_json=as_json)
        return []

    _following = False

    def handle(self, *args, **options) -> None:
        self._following = bool(options.get("follow"))
        if not self._following:
            return super().handle(*args, **options)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a follow ends
            super().handle(*args, **options)

    def _print(self, record: dict, *, as_json: bool) -> None:
        self.stdout.write(json.dumps(record) if as_json else record_text(record))
        self.stdout.flush()

    def describe(self, result: list[dict]) -> str:
        if not result:
            return "" if self._following else "(no records)"
        return "\n".join(record_text(r) for r in result)


def record_text(record: dict) -> str:
    """A record as a few lines for a terminal: the call, its lines, its exception."""
    at = datetime.fromtimestamp(record["at"], UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    version = f"v{record['version']}" if record.get("version") else "v?"
    status = record["status"] if record["status"] is not None else "-"
    head = f"{at}Z {record['request_id']} {record['outcome']} {status} {version} {'cold' if record['cold'] else 'warm'}"
    lines = [head]
    for line in record["logs"]:
        lines.append(f"  [{line['level']}] {line['text']}{' (cut)' if line['cut'] else ''}")
    if record["lines_cut"]:
        lines.append(f"  ({record['lines_cut']} more lines not kept)")
    if record["exception"]:
        thrown = record["exception"]
        lines.append(f"  ! {thrown['name']}: {thrown['message']}")
        lines.extend(f"    {frame.strip()}" for frame in thrown["stack"].splitlines() if frame.strip())
    return "\n".join(lines)
