"""Tail Workers, as Cloudflare runs them: once a call to a script is over, each Worker named in
its `tail_consumers` (for a script in a dispatch namespace: in those of the Worker binding the
namespace, Workers for Platforms' dispatch Worker) receives the call's TraceItems in its
`tail(events, env, ctx)` handler, off the call's path.

workerd produces the events (cfemulator.bound, TAIL_HEADER): a tailed script's process posts
them here under its process key; the emulator names the producer (`scriptName`, and
`dispatchNamespace` for a namespace script, which open-source workerd leaves empty), gives
each its call's wall and CPU time, which open-source workerd leaves at 0 (`cfemulator.timings`),
and hands them to each consumer's own process. Two differences from Cloudflare, both on the side
of less: a dispatch Worker's own events and its user Worker's reach the Tail Worker in two
`tail()` calls rather than one of two items, and events no consumer takes in time are dropped
with a warning in the emulator's log, as Cloudflare gives no guarantee of delivery either.

A Dynamic Worker's tails are what its loader Worker named in its code, such as the loader
Worker's own entrypoints (`ctx.exports`): the Dynamic Worker's process posts each batch of its
events here (DYNAMIC_TAIL_HEADER, `cfemulator.dynamic_host`), and the emulator hands the batch
back to the loader Worker's process, whose Worker Loader binding gives it to those tails
(`cfemulator.bound`).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import urllib3

from cfemulator.bound import DYNAMIC_TAIL_HEADER, EXCEPTION_MARK
from cfemulator.timings import CallTimings

logger = logging.getLogger(__name__)

# Used by the server's request threads at once: a pool per host as wide as they come, so a
# busy emulator keeps its connections instead of opening (and warning about) a new one each time.
# How long a call's events wait for its times: its answer may still be relayed to its caller.
TIMES_WAIT_SECONDS = 2.0
_SEND = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5.0, read=30.0), retries=False, maxsize=32)


class TailRelay:
    """Takes the events a tailed script's process posts and delivers them, two at a time."""

    def __init__(self, *, api: Any, scripts: Any, dynamic: Any, timings: CallTimings) -> None:
        self.api = api
        self.scripts = scripts
        self.dynamic = dynamic
        self.timings = timings
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cfemulator-tail")

    def received(self, key: str, body: bytes) -> int:
        """Queue the events of `key`'s process for its consumers; the status to answer."""
        try:
            events = json.loads(body)
        except ValueError:
            return 400
        if not isinstance(events, list):
            return 400
        self._pool.submit(self._deliver, key, events)
        return 204

    def received_dynamic(self, key: str, body: bytes) -> int:
        """Queue the events of the Dynamic Worker `key` for its loader Worker; the status to answer."""
        try:
            events = json.loads(body)
        except ValueError:
            return 400
        if not isinstance(events, list):
            return 400
        self._pool.submit(self._deliver_dynamic, key, events)
        return 204

    def _timed(self, key: str, events: list[Any]) -> None:
        """Each event of a call on `key`'s process with the call's wall and CPU time, as
        Cloudflare's trace gives them (cfemulator.timings); open-source workerd's are 0."""
        for event in events:
            ray = _ray_of(event)
            if ray is None:
                continue
            times = self.timings.taken(key, ray, wait_seconds=TIMES_WAIT_SECONDS)
            if times is not None:
                event["wallTime"], event["cpuTime"] = round(times.wall_ms), round(times.cpu_ms)

    def _deliver_dynamic(self, key: str, events: list[Any]) -> None:
        self._timed(key, events)
        body = json.dumps(events).encode()
        owner = self.dynamic.owner_of(key)
        running = self.scripts.running(owner) if owner is not None else None
        if running is None:
            logger.warning("the loader Worker of the Dynamic Worker %s is not running: its events are dropped", key)
            return
        try:
            answer = _SEND.request(
                "POST",
                f"http://127.0.0.1:{running.port}/",
                body=body,
                headers={"Content-Type": "application/json", DYNAMIC_TAIL_HEADER: key},
            )
            if answer.status >= 400:
                logger.warning(
                    "the tails of the Dynamic Worker %s did not take its events (%s): %s",
                    key,
                    answer.status,
                    answer.data[:2000].decode(errors="replace"),
                )
        except urllib3.exceptions.HTTPError as exc:
            logger.warning("the loader Worker of the Dynamic Worker %s did not take its events: %s", key, exc)

    def _deliver(self, key: str, events: list[dict[str, Any]]) -> None:
        name, namespace, consumers = self.api.tail_consumers_of(key)
        self._timed(key, events)
        for event in events:
            if isinstance(event, dict):
                event["scriptName"] = name
                if namespace is not None:
                    event["dispatchNamespace"] = namespace
                _thrown_back(event)
        body = json.dumps(events).encode()
        for consumer in consumers:
            try:
                with self.scripts.calling(
                    f"tail:{consumer.name}",
                    sha=consumer.sha,
                    upload=consumer.upload,
                    tails="consume",
                    generation=consumer.generation,
                ) as running:
                    answer = _SEND.request(
                        "POST",
                        f"http://127.0.0.1:{running.port}/",
                        body=body,
                        headers={"Content-Type": "application/json"},
                    )
                if answer.status >= 400:
                    logger.warning("tail consumer %s answered %s to %s's events", consumer.name, answer.status, name)
            except Exception as exc:  # one consumer's failure is no other's
                logger.warning("tail consumer %s did not take %s's events: %s", consumer.name, name, exc)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _ray_of(event: Any) -> str | None:
    """The ray id of the request whose call `event` traces, if it is a fetch event's."""
    info = event.get("event") if isinstance(event, dict) else None
    request = info.get("request") if isinstance(info, dict) else None
    headers = request.get("headers") if isinstance(request, dict) else None
    ray = headers.get("cf-ray") if isinstance(headers, dict) else None
    return ray if isinstance(ray, str) else None


def _thrown_back(event: dict[str, Any]) -> None:
    """The event of a namespace script whose exception went back to its caller, as Cloudflare's
    trace shows it: outcome "exception", the exception in `exceptions`, not in the logs."""
    logs = event.get("logs") if isinstance(event.get("logs"), list) else []
    marked = [log for log in logs if isinstance(log, dict) and (log.get("message") or [None])[0] == EXCEPTION_MARK]
    for log in marked:
        logs.remove(log)
        try:
            thrown = json.loads(log["message"][1])
        except (IndexError, TypeError, ValueError):
            continue
        event["outcome"] = "exception"
        event.setdefault("exceptions", []).append({**thrown, "timestamp": log.get("timestamp")})
