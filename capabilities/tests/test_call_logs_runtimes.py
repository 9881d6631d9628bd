"""A call's record on every runtime, from each runtime's own tail: locally the loader host's
tail hands it to the log sink; on Cloudflare (the emulator here, which runs Tail Workers as
Cloudflare does) the loader host's tail, or Sigil's Tail Worker (the worker-pool scripts'
`tail_consumers`, the platform dispatch Worker's), pushes it to Sigil's origin, and spools it
in the Worker's own KV namespace while the origin cannot be reached."""

import io
import json
import logging

import pytest
import requests
from django.contrib.auth.models import User
from django.core.management import call_command

from capabilities.books import call_logs
from capabilities.models import Binding, Capability
from capabilities.runtimes import get_runtime
from capabilities.tests.test_call_logs import CHATTY, CHATTY_LINES, LEAKS, logs
from sigil import redis_keys
from sigil.encryption import secret_encrypt
from testsupport.cast import grant, wait_for
from testsupport.relay import Relay

RUNTIMES = ["local", "loader", "worker-pool", "platform"]
CLOUDFLARE = ["loader", "worker-pool", "platform"]
FIXTURES = {"loader": "loader", "worker-pool": "worker_pool", "platform": "platform"}
# Long enough to outlast a cut and to be told apart from any other text.
SECRET = "hunter2-xyz-0123456789"


@pytest.fixture(params=RUNTIMES)
def on_runtime(request):
    """Sigil on each runtime in turn; the Cloudflare ones against the fresh emulator, their
    Workers pushing records to the test's server."""
    if request.param in FIXTURES:
        emulator = request.getfixturevalue(FIXTURES[request.param])
    if request.param == "worker-pool":
        # Sigil's Tail Worker is the system script the pool reserves a script of the account for.
        request.getfixturevalue("settings").SIGIL_LOGS_ENABLED = True
        emulator.configure(script_limit=8)
    return request.param


def record_of(agent, full, request_id):
    """The call's record once its tail handed it over (on Cloudflare: pushed it to the origin)."""

    def found():
        answer = logs(agent, full, request_id=request_id)
        assert answer.status_code == 200, answer.text
        return answer.json()["records"]

    [record] = wait_for(found, timeout=30, interval=0.1, message=f"the record of {request_id}")
    return record


def kept_ids(agent, full) -> list[str]:
    """The request ids of every record kept for `full`, one per record."""
    answer = logs(agent, full, limit=100)
    assert answer.status_code == 200, answer.text
    return [record["request_id"] for record in answer.json()["records"]]


def spool_of(runtime, cf_client) -> dict[str, list[str]]:
    """What waits in the spool of the Worker whose tail pushes `runtime`'s records: key →
    request ids of its batch (read over the API by the test, not by Sigil)."""
    kv_id = runtime.kv_id if runtime.name == "loader" else runtime.tails.kv_id
    spooled = {}
    for key in cf_client.kv_keys(kv_id, prefix="spool:"):
        batch = json.loads(cf_client.kv_get(kv_id, key["name"]))
        spooled[key["name"]] = [record["request_id"] for record in batch["records"]]
    return spooled


def test_a_capability_that_logs_and_throws_has_both_calls_recorded_on_every_runtime(on_runtime, alice, bob, client):
    alice.deploy(name="chatty", code=CHATTY, public=True)
    fine = alice.call("/alice/chatty/ok")
    boom = alice.call("/alice/chatty/boom")
    assert fine.status_code == 200 and boom.status_code >= 500

    ok = record_of(alice, "alice--chatty", fine.headers["X-Request-Id"])
    assert [(line["level"], line["text"]) for line in ok["logs"]] == CHATTY_LINES
    assert (ok["outcome"], ok["status"], ok["exception"]) == ("ok", 200, None)
    failed = record_of(alice, "alice--chatty", boom.headers["X-Request-Id"])
    assert failed["outcome"] == "exception"
    assert (failed["exception"]["name"], failed["exception"]["message"]) == ("TypeError", "exploded here")
    assert len(failed["logs"]) == 5

    # Read by the owning agent only; nothing was lost. Newest first in the order they were kept:
    # Cloudflare's Tail Workers may hand two calls' events over in either order.
    every = logs(alice, "alice--chatty").json()
    kept = [r["request_id"] for r in every["records"]]
    assert sorted(kept) == sorted([boom.headers["X-Request-Id"], fine.headers["X-Request-Id"]])
    assert every["lost"] == 0
    assert logs(bob, "alice--chatty").status_code == 404

    # The owner reads the same records with `manage.py logs` and on the capability's page.
    out = io.StringIO()
    call_command("logs", "alice--chatty", stdout=out)
    assert boom.headers["X-Request-Id"] in out.getvalue() and "! TypeError: exploded here" in out.getvalue()
    client.force_login(User.objects.create_superuser("owner", password="x"))
    capability = Capability.objects.get(full_name="alice--chatty")
    page = client.get(f"/admin/capabilities/capability/{capability.pk}/change/").content.decode()
    assert f'id="record-{boom.headers["X-Request-Id"]}"' in page and "exploded here" in page


def test_a_bound_secret_logged_or_thrown_is_kept_as_its_name_on_every_runtime(on_runtime, alice, redis_client):
    grant(Binding.objects.create(kind="SECRET", name="TOKEN", secret_encrypted=secret_encrypt(SECRET)), "alice")
    alice.deploy(name="leaky", code=LEAKS, bindings=["SECRET:TOKEN"])
    record = record_of(alice, "alice--leaky", alice.call("/alice/leaky").headers["X-Request-Id"])

    assert record["logs"][0]["text"] == "the token is [secret TOKEN] and again:[secret TOKEN]"
    assert record["exception"]["message"] == "failed with [secret TOKEN]"
    stored = b"".join(redis_client.lrange(redis_keys.logs("alice--leaky"), 0, -1))
    assert b"[secret TOKEN]" in stored and SECRET.encode() not in stored


def test_the_live_tail_streams_a_new_calls_record_on_every_runtime(on_runtime, alice):
    alice.deploy(name="chatty", code=CHATTY)
    url = f"{alice.base_url}/_api/capabilities/alice--chatty/logs/tail"
    headers = {**alice.headers(alice.invoke_token), "Accept": "text/event-stream"}
    with alice.session.get(url, params={"seconds": 20}, headers=headers, stream=True, timeout=40) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines(chunk_size=1, decode_unicode=True)
        assert next(lines) == ": following"
        called = alice.call("/alice/chatty/boom")
        record = next(json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: "))
    assert record["request_id"] == called.headers["X-Request-Id"]
    assert [line["text"] for line in record["logs"]][-1] == "it went wrong"
    assert record["exception"]["message"] == "exploded here"


@pytest.mark.parametrize("on_runtime", CLOUDFLARE, indirect=True)
def test_a_record_that_does_not_fit_is_counted_as_lost_on_the_cloudflare_runtimes(on_runtime, alice, settings):
    # Pushed records are kept within the settings' bounds as Sigil takes them.
    settings.SIGIL_LOGS_AGENT_BYTES = 50
    alice.deploy(name="chatty", code=CHATTY)
    alice.call("/alice/chatty/ok")

    def lost():
        return logs(alice, "alice--chatty").json()["lost"]

    assert wait_for(lost, timeout=30, interval=0.1, message="the lost record counted") == 1
    assert logs(alice, "alice--chatty").json()["records"] == []


@pytest.mark.parametrize("on_runtime", CLOUDFLARE, indirect=True)
def test_records_reach_the_origin_with_no_api_request_on_the_cloudflare_runtimes(
    on_runtime, alice, redis_client, cf_emulator_fresh
):
    alice.deploy(name="chatty", code=CHATTY)
    # The first call may still ask the API (the account's workers.dev subdomain, once a process).
    record_of(alice, "alice--chatty", alice.call("/alice/chatty/ok").headers["X-Request-Id"])
    api_calls, logged = int(redis_client.get(redis_keys.CF_CALLS) or 0), len(cf_emulator_fresh.api_calls())

    burst = [alice.call("/alice/chatty/ok").headers["X-Request-Id"] for _ in range(20)]
    for request_id in burst:
        record_of(alice, "alice--chatty", request_id)

    assert int(redis_client.get(redis_keys.CF_CALLS) or 0) == api_calls
    assert len(cf_emulator_fresh.api_calls()) == logged
    taken, again = call_logs.call_records_pushes()
    assert taken >= 1 and again == 0


@pytest.mark.parametrize("on_runtime", CLOUDFLARE, indirect=True)
def test_records_spooled_while_the_origin_is_out_of_reach_arrive_once_each_when_it_is_back(
    on_runtime, sigil, alice, settings, cf_client
):
    origin = Relay(target=int(sigil.url.rsplit(":", 1)[1]))  # closed: nothing listens there yet
    settings.SIGIL_ORIGIN_URL = origin.url
    try:
        alice.deploy(name="chatty", code=CHATTY)
        while_away = [alice.call("/alice/chatty/ok") for _ in range(3)]
        assert all(answer.status_code == 200 for answer in while_away)  # calls go on
        ids = [answer.headers["X-Request-Id"] for answer in while_away]

        def all_spooled():
            waiting = spool_of(get_runtime(), cf_client)
            return sorted(i for batch in waiting.values() for i in batch) == sorted(ids)

        wait_for(all_spooled, timeout=30, interval=0.2, message="the records spooled in the Worker's KV")
        assert kept_ids(alice, "alice--chatty") == []

        origin.open()
        # The next push that gets through drains the spool.
        ids.append(alice.call("/alice/chatty/ok").headers["X-Request-Id"])
        wait_for(
            lambda: sorted(kept_ids(alice, "alice--chatty")) == sorted(ids),
            timeout=30,
            interval=0.1,
            message="every record at the origin",
        )
        wait_for(lambda: not spool_of(get_runtime(), cf_client), timeout=10, message="the spool emptied")
        assert sorted(kept_ids(alice, "alice--chatty")) == sorted(ids)  # once each
        assert call_logs.call_records_undelivered_count() == 0
    finally:
        origin.close()


@pytest.mark.parametrize("on_runtime", CLOUDFLARE, indirect=True)
def test_records_past_the_spools_bound_are_counted_as_lost(on_runtime, sigil, alice, settings, cf_client, caplog):
    settings.SIGIL_LOGS_SPOOL_BATCHES = 1
    settings.SIGIL_METRICS_TOKEN = "scrape"
    caplog.set_level(logging.INFO, logger="capabilities.workerd.output")
    origin = Relay(target=int(sigil.url.rsplit(":", 1)[1]))
    settings.SIGIL_ORIGIN_URL = origin.url
    try:
        alice.deploy(name="chatty", code=CHATTY)
        spooled = alice.call("/alice/chatty/ok").headers["X-Request-Id"]
        wait_for(lambda: spool_of(get_runtime(), cf_client), timeout=30, interval=0.2, message="one batch spooled")
        beyond = alice.call("/alice/chatty/ok").headers["X-Request-Id"]
        # The Worker says so when it drops a batch it may not spool.
        wait_for(
            lambda: any("call records not delivered" in r.getMessage() for r in caplog.records),
            timeout=60,
            interval=0.2,
            message="the batch past the bound dropped",
        )
        assert len(spool_of(get_runtime(), cf_client)) == 1

        origin.open()
        after = alice.call("/alice/chatty/ok").headers["X-Request-Id"]
        wait_for(
            lambda: sorted(kept_ids(alice, "alice--chatty")) == sorted([spooled, after]),
            timeout=30,
            interval=0.1,
            message="the spooled record and the next one at the origin",
        )
        assert beyond not in kept_ids(alice, "alice--chatty")
        # Counted for its capability, where its owner reads its records, as well as in all.
        assert logs(alice, "alice--chatty").json()["lost"] == 1
        metrics = requests.get(f"{sigil.url}/metrics", headers={"Authorization": "Bearer scrape"}, timeout=10).text
        assert 'sigil_call_records_lost_total{why="undelivered"} 1.0' in metrics
    finally:
        origin.close()


# Waits WAIT_MS on a timer, then burns CPU for a while (a fixed count of steps: workerd's
# clock does not move while code runs).
WAIT_MS = 200
WAITS_AND_BURNS = f"""export default {{ async fetch() {{
  await new Promise((resolve) => setTimeout(resolve, {WAIT_MS}));
  let x = 0;
  for (let i = 0; i < 20000000; i++) x = (x * 31 + i) | 0;
  return new Response(String(x));
}} }}"""


def test_a_record_carries_the_calls_wall_time_and_its_cpu_time_where_the_runtime_gives_it(on_runtime, alice, client):
    alice.deploy(name="slow", code=WAITS_AND_BURNS)
    answer = alice.call("/alice/slow")
    assert answer.status_code == 200, answer.text
    record = record_of(alice, "alice--slow", answer.headers["X-Request-Id"])

    assert record["wall_ms"] >= WAIT_MS
    if on_runtime == "local":
        # Open-source workerd measures no CPU time: the record says it is not given.
        assert record["cpu_ms"] is None
        shown = "CPU time not given by this runtime"
    else:
        # Cloudflare's trace gives it; the emulator measures it as its processes spend it.
        assert 0 < record["cpu_ms"] <= record["wall_ms"]
        shown = f"{record['cpu_ms']:.1f} ms CPU"
    client.force_login(User.objects.create_superuser("owner", password="x"))
    capability = Capability.objects.get(full_name="alice--slow")
    page = client.get(f"/admin/capabilities/capability/{capability.pk}/change/").content.decode()
    assert f"{record['wall_ms']:.1f} ms, {shown}" in page
