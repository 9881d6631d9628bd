"""The log's two formats and what counts as routine."""

import io
import json
import logging

from sigil.logs import RoutineAtDebug, SigilFormatter, relayed_line
from sigil.request_id import set_request_id


def handler_output(kind: str, *, root_level: int = logging.INFO):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(SigilFormatter(kind=kind, process="web"))
    handler.addFilter(RoutineAtDebug())
    return stream, handler


def log_through(handler, name: str, level: int, message: str, *args, **kwargs) -> None:
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        logger.log(level, message, *args, **kwargs)
    finally:
        logger.removeHandler(handler)


def test_json_lines_carry_time_level_process_request_id_and_extra_fields():
    stream, handler = handler_output("json")
    set_request_id("0123456789abcdef")
    try:
        log_through(handler, "sigil.test", logging.WARNING, "hello %s", "there", extra={"status": 503})
    finally:
        set_request_id(None)
    record = json.loads(stream.getvalue())
    assert record["message"] == "hello there" and record["level"] == "WARNING"
    assert (record["process"], record["logger"], record["status"]) == ("web", "sigil.test", 503)
    assert record["request_id"] == "0123456789abcdef"
    assert record["time"].endswith("Z") and "T" in record["time"]


def test_an_exception_stays_inside_its_json_record():
    stream, handler = handler_output("json")
    try:
        raise ValueError("boom")
    except ValueError:
        log_through(handler, "sigil.test", logging.ERROR, "failed", exc_info=True)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "ValueError: boom" in json.loads(lines[0])["exception"]


def test_text_lines_read_on_a_terminal():
    stream, handler = handler_output("text")
    log_through(handler, "sigil.access", logging.INFO, "GET /a/b 200", extra={"ms": 1.5, "capability": "a--b"})
    line = stream.getvalue().strip()
    assert line.endswith("INFO    web sigil.access GET /a/b 200 ms=1.5 capability=a--b")


def test_celerys_routine_lines_are_debug_and_hidden_at_info():
    stream, handler = handler_output("json")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        log_through(handler, "celery.beat", logging.INFO, "Scheduler: Sending due task %s (%s)", "flush", "x")
        log_through(handler, "celery.app.trace", logging.INFO, "Task %(name)s[%(id)s] succeeded in %(runtime)ss")
        log_through(handler, "celery.beat", logging.INFO, "beat: Starting...")
        assert [json.loads(line)["message"] for line in stream.getvalue().splitlines()] == ["beat: Starting..."]
        root.setLevel(logging.DEBUG)
        log_through(handler, "celery.beat", logging.INFO, "Scheduler: Sending due task %s (%s)", "flush", "x")
        assert json.loads(stream.getvalue().splitlines()[-1])["level"] == "DEBUG"
    finally:
        root.setLevel(level)


def test_the_supervisor_keeps_lines_in_the_format_and_wraps_the_others():
    ours = json.dumps({"time": "t", "level": "INFO", "process": "web", "logger": "x", "message": "m"})
    assert relayed_line("web", ours, kind="json") == ours
    wrapped = json.loads(relayed_line("celery", "worker: Warm shutdown", kind="json"))
    assert (wrapped["process"], wrapped["message"]) == ("celery", "worker: Warm shutdown")
    assert relayed_line("redis", "Ready to accept", kind="text", width=6) == "redis  | Ready to accept"
    text = "2026-12-01T11:10:19.413Z INFO    web _granian Listening"
    assert relayed_line("web", text, kind="text", width=6) == text
