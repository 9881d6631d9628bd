"""Ordinary traffic on every Cloudflare runtime, through the real parts: Sigil's REST API and
gateway over HTTP, the emulator over HTTP (its Workers pushing call records to the origin, the
edge on, as `make run` has it there), a real Celery worker placing deploys, and beat's
housekeeping and the edge's publisher on beat's own schedule, compressed.

The API budget is shrunk to fit a test with the same ratio of calls to budget as 10 calls a
second against the default (SIGIL_CF_RATE_LIMIT 1,000 per 300 s): 30 requests per 9 s, and beat's
intervals by the same 300/9. Ten calls a second for two windows, a deploy and a page-in amid
them: every call is answered 200, the deploy 201 and the page-in a cold 200, each within the 2 s
they may wait for room; and the emulator's record of the API requests shows the traffic spent
none of them (its records arrive by push, and it changes nothing the edge's publisher writes),
housekeeping no more than its share."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter

import pytest
from django.conf import settings as django_settings

from capabilities import services
from capabilities.books import call_logs
from capabilities.models import Capability
from capabilities.runtimes import runtimes_forget
from capabilities.runtimes.errors import RuntimeFailure
from sigil import redis_keys
from sigil_site.celery import app as celery_app
from testsupport.cast import deploy_answering, wait_for
from testsupport.steady import SteadyCalls

FIXTURES = {"worker-pool": "worker_pool", "platform": "platform", "loader": "loader"}
# Cloudflare's window, as Sigil's defaults keep it, and the test's: beat's schedule runs this
# many times faster.
DEFAULT_WINDOW_SECONDS = 300.0
WINDOW_SECONDS = 9.0
BUDGET = 30  # per WINDOW_SECONDS: 1,000 per 300 s, as the default
CALLS_PER_SECOND = 10
# How long a deploy's and a page-in's requests may wait for room: a budget that traffic or
# housekeeping had taken would refuse them.
MAX_RATE_WAIT_SECONDS = 2


@pytest.fixture(params=list(FIXTURES))
def traffic(request, settings, cf_settings):
    """Sigil on one Cloudflare runtime (each in turn) as `make run` has it on the emulator, call
    records and the edge on, its budget shrunk."""
    settings.SIGIL_EDGE = True  # before the runtime's fixture, which counts the edge's script
    emulator = request.getfixturevalue(FIXTURES[request.param])
    if request.param == "worker-pool":
        # Sigil's Tail Worker and the edge's Worker are the two system scripts the pool reserves
        # scripts of the account for; three slots still.
        cf_settings.SIGIL_LOGS_ENABLED = True
        cf_settings.SIGIL_POOL_SYSTEM_RESERVED = 2
        cf_settings.SIGIL_POOL_TOTAL_QUOTA = 9
        emulator.configure(script_limit=9)
    assert cf_settings.SIGIL_LOGS_ENABLED
    cf_settings.SIGIL_CF_RATE_LIMIT = BUDGET
    cf_settings.SIGIL_CF_RATE_WINDOW_SECONDS = WINDOW_SECONDS
    cf_settings.SIGIL_CF_MAX_RATE_WAIT_SECONDS = MAX_RATE_WAIT_SECONDS
    # Every call's record kept, so that each can be found.
    cf_settings.SIGIL_LOGS_RECORDS_PER_CAPABILITY = 1000
    runtimes_forget()
    return emulator


def beat_schedule() -> dict[str, float]:
    """Beat's tasks and their intervals, the edge's among them as settings.py adds them when the
    edge is on (this process read its settings with the edge off)."""
    schedule = {entry["task"]: float(entry["schedule"]) for entry in django_settings.CELERY_BEAT_SCHEDULE.values()}
    if django_settings.SIGIL_EDGE:
        schedule["capabilities.edge_publish"] = django_settings.SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS
        schedule["capabilities.edge_reconcile"] = django_settings.SIGIL_EDGE_RECONCILE_INTERVAL_SECONDS
    return schedule


class CompressedBeat:
    """Beat's schedule in a thread while its `with` block lasts, every interval divided by
    `speed`: each task due is run as a worker runs it (its class of API work set by its base;
    housekeeping that finds no room skips until its next run)."""

    def __init__(self, *, speed: float) -> None:
        self.entries = [(name, interval / speed) for name, interval in beat_schedule().items()]
        self.runs: Counter = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compressed-beat", daemon=True)

    def _run(self) -> None:
        due = dict.fromkeys([name for name, _ in self.entries], time.monotonic())
        while not self._stop.is_set():
            for name, interval in self.entries:
                if time.monotonic() < due[name]:
                    continue
                due[name] = time.monotonic() + interval
                try:
                    celery_app.tasks[name]()
                except RuntimeFailure as exc:  # a worker retries it, or the next beat runs it
                    self.failures.append(f"{name}: {exc}")
                self.runs[name] += 1
            self._stop.wait(0.05)

    def __enter__(self) -> CompressedBeat:
        celery_app.loader.import_default_modules()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def spent_by_class(redis_client) -> Counter:
    """Sigil's own count of its API requests so far, by the class of work they were made for."""
    return Counter(
        {key.decode(): int(count) for key, count in redis_client.hgetall(redis_keys.CF_CALLS_BY_CLASS).items()}
    )


@contextlib.contextmanager
def apart(redis_client, spans: list[tuple[float, float]], spent: list[Counter]):
    """The block's time span (epoch) is added to `spans`, its API requests by class to `spent`."""
    before, started = spent_by_class(redis_client), time.time()
    yield
    spent.append(spent_by_class(redis_client) - before)
    spans.append((started, time.time()))


@pytest.mark.slow
def test_ten_calls_a_second_leave_the_budget_to_a_deploy_and_a_page_in(traffic, alice, redis_client):
    deploy_answering(alice, "steady", "steady")
    deploy_answering(alice, "cold", "cold")
    services.capability_evict(full="alice--cold", actor="owner:test")
    assert Capability.objects.get(full_name="alice--cold").state == "paged_out"
    assert alice.call("/alice/steady").text == "steady"
    steady = SteadyCalls(
        f"{alice.base_url}/alice/steady", headers=alice.headers(alice.invoke_token), per_second=CALLS_PER_SECOND
    )
    spans, spent = [], []  # the deploy's and the page-in's
    # What was done so far is at the edge, as beat's publisher has it by now.
    celery_app.tasks["capabilities.edge_publish"]()

    started, before = time.time(), spent_by_class(redis_client)
    with CompressedBeat(speed=DEFAULT_WINDOW_SECONDS / WINDOW_SECONDS) as beat, steady:
        time.sleep(WINDOW_SECONDS + 1)  # a whole window of traffic alone
        with apart(redis_client, spans, spent):
            deployed = alice.deploy(name="new", code="export default { fetch() { return new Response('new') } }")
        with apart(redis_client, spans, spent):
            paged_in = alice.call("/alice/cold")
        time.sleep(max(0.0, started + 2 * WINDOW_SECONDS + 1 - time.time()))  # and the second window to its end
    ended, after = time.time(), spent_by_class(redis_client)

    assert deployed.status_code == 201, deployed.text
    assert alice.call("/alice/new").text == "new"
    assert (paged_in.status_code, paged_in.text) == (200, "cold"), paged_in.text
    assert paged_in.headers["X-Sigil-Cold-Start"] == "1"
    answered = Counter(steady.answers)
    assert set(answered) == {(200, "steady")}, answered  # no 429, no 503, no other answer to anyone
    assert answered[(200, "steady")] >= 5 * 2 * WINDOW_SECONDS  # sustained traffic, on a loaded machine too
    assert beat.runs["capabilities.capability_reconcile"] >= 2 and not beat.failures, (beat.runs, beat.failures)

    # What Sigil spent besides the deploy and the page-in was housekeeping, within its share
    # of each window the traffic spanned, and the edge's publisher writing what they changed
    # (work of the deploy class: one bulk write a run): not one request for the calls.
    besides = after - before
    for during in spent:
        besides -= during
    assert set(besides) <= {"housekeeping", "deploy"}, besides
    share = django_settings.SIGIL_CF_HOUSEKEEPING_SHARE * BUDGET
    windows = math.ceil((ended - started) / WINDOW_SECONDS)
    assert besides["housekeeping"] <= share * windows, besides
    received = [call for call in traffic.api_calls() if started <= call["time"] <= ended]
    publishes = [call for call in received if call["method"] == "PUT" and call["path"].endswith("/bulk")]
    assert besides["deploy"] <= len(publishes) <= 4, besides  # the deploy's and the page-in's changes
    # The emulator's own record agrees: in the window of traffic alone, it received
    # housekeeping's requests and nothing else (the calls changed nothing the edge decides by);
    # outside the deploy and the page-in, the publisher's writes besides; none was refused.
    alone = [call for call in received if call["time"] < spans[0][0]]
    assert not [call for call in alone if call in publishes], alone
    assert len(alone) <= share * math.ceil((spans[0][0] - started) / WINDOW_SECONDS), alone
    outside = [call for call in received if not any(since <= call["time"] <= until for since, until in spans)]
    assert len([call for call in outside if call not in publishes]) <= share * windows, outside
    assert not [call for call in traffic.api_calls() if call["status"] == 429]

    # Every call's record arrived, pushed to the origin by the runtime's own Worker.
    calls = len(steady.answers) + 1  # and the one before the traffic

    def records_kept() -> bool:
        return redis_client.llen(redis_keys.logs("alice--steady")) >= calls

    wait_for(records_kept, timeout=30, interval=0.2, message=f"the records of {calls} calls")
    assert call_logs.call_records_pushes()[0] >= 2
    assert call_logs.call_records_lost(full="alice--steady") == 0
