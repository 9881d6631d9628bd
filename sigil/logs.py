"""One log for every process Sigil starts: the same fields in text or JSON lines
(SIGIL_LOG_FORMAT), ISO timestamps, the process's name and the request id where there is
one; routine background work at DEBUG.

Kept free of Django's settings, so that granian's own logging and the supervisor's relay
can use it before (or without) Django being set up.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from datetime import UTC, datetime

from sigil.request_id import current_request_id

FORMATS = ("text", "json")
# Attributes every LogRecord has; anything else was passed as `extra` and is logged as a field.
_RECORD_ATTRIBUTES = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "request_id"}


def _record_with_request_id(factory):
    """Each record takes the request id where it is created (the serving thread), whichever
    handler formats it later, and wherever."""

    def make(*args, **kwargs) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        record.request_id = current_request_id()
        return record

    make.sigil = True
    return make


if not getattr(logging.getLogRecordFactory(), "sigil", False):
    logging.setLogRecordFactory(_record_with_request_id(logging.getLogRecordFactory()))


def log_format() -> str:
    kind = os.environ.get("SIGIL_LOG_FORMAT", "") or "text"
    return kind if kind in FORMATS else "text"


def process_name() -> str:
    """SIGIL_PROCESS_NAME, else what the command line says this process is."""
    named = os.environ.get("SIGIL_PROCESS_NAME", "")
    if named:
        return named
    argv0 = sys.argv[0] if sys.argv else "python"
    program = os.path.basename(argv0)
    if program == "__main__.py":  # python -m PACKAGE
        program = os.path.basename(os.path.dirname(argv0))
    if program in ("granian", "gunicorn"):
        return "web"
    if program == "celery" or "celery" in sys.argv[1:3]:
        return "celery"
    if program == "manage.py" and len(sys.argv) > 1:
        return "supervisor" if sys.argv[1] == "runsigil" else sys.argv[1]
    return program


def iso_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class SigilFormatter(logging.Formatter):
    """`kind` "json": one object per line (time, level, process, logger, message, request_id,
    the record's extra fields, exception). "text": the same on one line, for a terminal."""

    def __init__(self, kind: str | None = None, process: str | None = None) -> None:
        super().__init__()
        self.kind = kind or log_format()
        self.process = process or process_name()

    def format(self, record: logging.LogRecord) -> str:
        fields = {
            "time": iso_time(record.created),
            "level": record.levelname,
            "process": self.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            fields["request_id"] = request_id
        fields.update(
            (key, value)
            for key, value in vars(record).items()
            if key not in _RECORD_ATTRIBUTES and key not in fields and not key.startswith("_")
        )
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            fields["exception"] = self.formatStack(record.stack_info)
        if self.kind == "json":
            return json.dumps(fields, default=str)
        return text_line(fields)


def text_line(fields: dict) -> str:
    head = f"{fields['time']} {fields['level']:<7} {fields['process']} {fields['logger']}"
    if fields.get("request_id"):
        head += f" [{fields['request_id']}]"
    rest = " ".join(
        f"{key}={json.dumps(value, default=str) if not isinstance(value, str) or ' ' in value else value}"
        for key, value in fields.items()
        if key not in ("time", "level", "process", "logger", "message", "request_id", "exception")
    )
    line = f"{head} {fields['message']}" + (f" {rest}" if rest else "")
    if fields.get("exception"):
        line += "\n" + fields["exception"]
    return line


# Celery's lines for every periodic run and every task (the stats flush every 10 s): at
# DEBUG, so that INFO is what changed.
_ROUTINE = {
    "celery.beat": re.compile(r"^Scheduler: Sending due task"),
    "celery.worker.strategy": re.compile(r"^Task .* received"),
    "celery.app.trace": re.compile(r"^Task .* succeeded"),
}


class RoutineAtDebug(logging.Filter):
    """Demote routine INFO lines to DEBUG, shown only when the root level is DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        pattern = _ROUTINE.get(record.name)
        if record.levelno == logging.INFO and pattern and pattern.match(str(record.msg)):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


_OURS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")


def relayed_line(program: str, line: str, *, kind: str, width: int = 0) -> str:
    """A line a child process printed, as the supervisor writes it: a line already in
    Sigil's format as it is, anything else (a banner, a program's own format) in it."""
    if kind == "json":
        if line.startswith("{"):
            try:
                json.loads(line)
                return line
            except ValueError:
                pass
        return json.dumps(
            {"time": iso_time(datetime.now(UTC).timestamp()), "level": "INFO", "process": program,
             "logger": "output", "message": line}
        )  # fmt: skip
    return line if _OURS.match(line) else f"{program:<{width}} | {line}"


def logging_config(*, kind: str, process: str, level: str, access_log: bool) -> dict:
    """The dictConfig of every Sigil process (Django's LOGGING, Celery's, granian's)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"sigil": {"()": "sigil.logs.SigilFormatter", "kind": kind, "process": process}},
        "filters": {"routine": {"()": "sigil.logs.RoutineAtDebug"}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "sigil", "filters": ["routine"]},
        },
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            "django.server": {"level": "WARNING"},
            # Every login and failure is INFO there; lock-outs are WARNING.
            "axes": {"level": "WARNING"},
            "sigil.access": {"level": "INFO" if access_log else "WARNING"},
            # granian's own loggers, when it reads this configuration.
            "_granian": {"level": "INFO"},
            "granian.access": {"level": "WARNING"},
        },
    }
