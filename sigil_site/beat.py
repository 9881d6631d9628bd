"""Beat's schedule as the owner sees it: each periodic task, how often it runs, and when a
worker last finished it (recorded in Redis by the Celery signal handlers in celery.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from celery.schedules import schedule as celery_schedule
from django.conf import settings

from sigil import redis_keys
from sigil.redis_client import get_redis


@dataclass(frozen=True)
class BeatEntry:
    name: str
    task: str
    every: timedelta | None  # None for a crontab or another kind of schedule
    schedule: str
    last_run_at: datetime | None
    last_ok: bool | None
    last_error: str

    @property
    def next_due_at(self) -> datetime | None:
        """When beat sends it next, if it ran on time so far (beat keeps its own clock)."""
        if self.every is None or self.last_run_at is None:
            return None
        return self.last_run_at + self.every


def scheduled_task_names() -> frozenset[str]:
    return frozenset(entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values())


def beat_record_run(*, task: str, ok: bool, at_epoch: float, error: str = "") -> None:
    """Remember the last run of a periodic task; other tasks are ignored. Idempotent."""
    if task not in scheduled_task_names():
        return
    value = json.dumps({"at": at_epoch, "ok": ok, "error": error[:200]})
    get_redis().hset(redis_keys.BEAT_LAST_RUN, task, value)


def beat_schedule_list() -> list[BeatEntry]:
    """Every entry of CELERY_BEAT_SCHEDULE with its interval and last recorded run."""
    raw = get_redis().hgetall(redis_keys.BEAT_LAST_RUN)
    runs = {task.decode(): json.loads(value) for task, value in raw.items()}
    entries = []
    for name, entry in sorted(settings.CELERY_BEAT_SCHEDULE.items()):
        every, text = _interval(entry["schedule"])
        run = runs.get(entry["task"])
        entries.append(
            BeatEntry(
                name=name,
                task=entry["task"],
                every=every,
                schedule=text,
                last_run_at=datetime.fromtimestamp(run["at"], tz=UTC) if run else None,
                last_ok=run["ok"] if run else None,
                last_error=run["error"] if run else "",
            )
        )
    return entries


def _interval(value) -> tuple[timedelta | None, str]:
    if isinstance(value, int | float):
        every = timedelta(seconds=value)
    elif isinstance(value, timedelta):
        every = value
    elif isinstance(value, celery_schedule) and not hasattr(value, "minute"):
        every = value.run_every
    else:
        return None, str(value)  # a crontab or solar schedule says what it is itself
    return every, "every " + _duration(every)


def _duration(every: timedelta) -> str:
    seconds = every.total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{seconds:g} s"
