"""Compatibility dates and flags, checked at upload as Cloudflare checks them.

Cloudflare compiles an upload's date and flags with workerd's rules for its own edge
(`compileCompatibilityFlags`, CURRENT_DATE_FOR_CLOUDFLARE in workerd's
src/workerd/io/compatibility-date.c++) and refuses the upload with 400, code 10021, naming
the first problem: a date after today (UTC), or a flag workerd does not know. The
emulator's "today" is also bounded by its own workerd, which cannot run a date newer than
its release.
"""

from __future__ import annotations

import re
import subprocess
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

from cfemulator.envelope import ApiError

_FLAGS_FILE = Path(__file__).with_name("compatibility_flags.txt")
_VERSION_DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")


@cache
def known_flags() -> frozenset[str]:
    lines = _FLAGS_FILE.read_text().splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def runtime_date(workerd_binary: str) -> str | None:
    """The newest compatibility date `workerd_binary` runs (`workerd --version` names it),
    or None when it does not say."""
    try:
        out = subprocess.run([workerd_binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return None
    match = _VERSION_DATE.search(out)
    return match.group(1) if match else None


def check_compatibility(date: str, flags: list[str], *, newest: str | None) -> None:
    """Refuse `date` and `flags` as Cloudflare does (400, 10021), with workerd's wording."""
    today = datetime.now(UTC).date().isoformat()
    if newest is not None:
        today = min(today, newest)
    if date > today:
        raise ApiError(400, 10021, f"Can't set compatibility date in the future: {date}")
    known = known_flags()
    for flag in flags:
        if flag not in known:
            raise ApiError(400, 10021, f"No such compatibility flag: {flag}")
