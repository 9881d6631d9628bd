"""Compatibility dates and flags, checked at upload as Cloudflare checks them.

Cloudflare compiles an upload's date and flags with workerd's rules for its own edge
(`compileCompatibilityFlags`, CURRENT_DATE_FOR_CLOUDFLARE in workerd's
src/workerd/io/compatibility-date.c++) and refuses the upload with 400, code 10021, naming
the problem: a date after today (UTC), or a flag workerd does not know. The emulator asks
its own workerd what it knows: its release date bounds "today" (it cannot run a later one),
and its flags are those of the compatibility schema compiled into it.
"""

from __future__ import annotations

import logging
import mmap
import re
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime

from cfemulator.envelope import ApiError

logger = logging.getLogger(__name__)

_VERSION_DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")
# workerd carries its compatibility schema compiled in: the struct's name, then each field's
# name (camelCase) with its annotations' values (the flags' names, snake_case, and dates).
_SCHEMA_MARKER = b"workerd/io/compatibility-date.capnp:CompatibilityFlags\x00"
_SCHEMA_SPAN = 300_000
_TEXT = re.compile(rb"[\x20-\x7e]{3,}")
_FLAG = re.compile(r"[a-z][a-z0-9]*(?:[_-][a-z0-9]+)*")
# Fields retired from the schema keep a placeholder name that is no flag.
_RETIRED_FIELD = re.compile(r"obsolete\d+")


@dataclass(frozen=True)
class RuntimeCompat:
    """What the emulator's workerd runs: the newest date, and the flags it knows (None when
    its schema could not be read: flags are then not checked)."""

    newest_date: str | None
    flags: frozenset[str] | None


def read_runtime(workerd_binary: str) -> RuntimeCompat:
    return RuntimeCompat(newest_date=_release_date(workerd_binary), flags=_schema_flags(workerd_binary))


def check_compatibility(date: str, flags: list[str], runtime: RuntimeCompat | None) -> None:
    """Refuse `date` and `flags` as Cloudflare does (400, 10021), with workerd's wording."""
    today = datetime.now(UTC).date().isoformat()
    if runtime is not None and runtime.newest_date is not None:
        today = min(today, runtime.newest_date)
    if date > today:
        raise ApiError(400, 10021, f"Can't set compatibility date in the future: {date}")
    if runtime is None or runtime.flags is None:
        return
    for flag in flags:
        if flag not in runtime.flags:
            raise ApiError(400, 10021, f"No such compatibility flag: {flag}")


def _release_date(workerd_binary: str) -> str | None:
    """The newest date `workerd --version` names (its release's)."""
    try:
        out = subprocess.run([workerd_binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _VERSION_DATE.search(out)
    return match.group(1) if match else None


def _schema_flags(workerd_binary: str) -> frozenset[str] | None:
    """The flag names of the compatibility schema compiled into `workerd_binary`."""
    try:
        with open(workerd_binary, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as image:
            start = image.find(_SCHEMA_MARKER)
            if start < 0:
                logger.warning("no compatibility schema in %s: compatibility flags are not checked", workerd_binary)
                return None
            span = image[start + len(_SCHEMA_MARKER) : start + len(_SCHEMA_MARKER) + _SCHEMA_SPAN]
    except OSError:
        return None
    flags = set()
    for raw in _TEXT.findall(span):
        text = raw.decode()
        if text.startswith("---"):
            break  # past the schema: the binary's next data
        if _FLAG.fullmatch(text) and not _RETIRED_FIELD.fullmatch(text):
            flags.add(text)
    return frozenset(flags)
