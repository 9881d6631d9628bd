"""A call's record on every runtime, from each runtime's own tail: locally the loader host's
tail hands it to the log sink; on Cloudflare (the emulator here, which runs Tail Workers as
Cloudflare does) the loader host's tail, or Sigil's Tail Worker (the worker-pool scripts'
`tail_consumers`, the platform dispatch Worker's), leaves it in Workers KV for Sigil to
collect."""

import io
import json
import threading

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command

from capabilities import call_logs
from capabilities.models import Binding, Capability
from capabilities.runtimes import get_runtime
from capabilities.services.call_records import call_records_collect
from capabilities.tests.test_call_logs import CHATTY, CHATTY_LINES, LEAKS, logs
from sigil.encryption import secret_encrypt
from testsupport.cast import grant, wait_for

RUNTIMES = ["local", "loader", "worker-pool", "platform"]
FIXTURES = {"loader": "loader", "worker-pool": "worker_pool", "platform": "platform"}
# Long enough to outlast a cut and to be told apart from any other text.
SECRET = "hunter2-xyz-0123456789"


@pytest.fixture(params=RUNTIMES)
def on_runtime(request):
    """Sigil on each runtime in turn; the Cloudflare ones against the fresh emulator."""
    if request.param in FIXTURES:
        emulator = request.getfixturevalue(FIXTURES[request.param])
    if request.param == "worker-pool":
        # Sigil's Tail Worker is the system script the pool reserves a script of the account for.
        request.getfixturevalue("settings").SIGIL_LOGS_ENABLED = True
        emulator.configure(script_limit=8)
    return request.param


def record_of(agent, full, request_id):
    """The call's record once its tail handed it over (and, on Cloudflare, once Sigil took it
    from where the tail left it: the beat's task, run here in the test's own time)."""

    def found():
        call_records_collect(runtime=get_runtime())
        answer = logs(agent, full, request_id=request_id)
        assert answer.status_code == 200, answer.text
        return answer.json()["records"]

    [record] = wait_for(found, timeout=30, interval=0.2, message=f"the record of {request_id}")
    return record


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
    stored = b"".join(redis_client.lrange(call_logs.records_key("alice--leaky"), 0, -1))
    assert b"[secret TOKEN]" in stored and SECRET.encode() not in stored


def test_the_live_tail_streams_a_new_calls_record_on_every_runtime(on_runtime, alice):
    alice.deploy(name="chatty", code=CHATTY)
    url = f"{alice.base_url}/_api/capabilities/alice--chatty/logs/tail"
    headers = {**alice.headers(alice.invoke_token), "Accept": "text/event-stream"}
    called, done = [], threading.Event()

    def collect():  # the beat's task, while the tail follows
        while not done.wait(0.2):
            call_records_collect(runtime=get_runtime())

    collector = threading.Thread(target=collect)
    collector.start()
    try:
        with alice.session.get(url, params={"seconds": 20}, headers=headers, stream=True, timeout=40) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines(chunk_size=1, decode_unicode=True)
            assert next(lines) == ": following"
            called.append(alice.call("/alice/chatty/boom"))
            record = next(json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: "))
    finally:
        done.set()
        collector.join()
    assert record["request_id"] == called[0].headers["X-Request-Id"]
    assert [line["text"] for line in record["logs"]][-1] == "it went wrong"
    assert record["exception"]["message"] == "exploded here"


@pytest.mark.parametrize("on_runtime", ["loader", "worker-pool", "platform"], indirect=True)
def test_a_record_that_does_not_fit_is_counted_as_lost_on_the_cloudflare_runtimes(on_runtime, alice, settings):
    # Collected records are kept within the settings' bounds as Sigil takes them.
    settings.SIGIL_LOGS_AGENT_BYTES = 50
    alice.deploy(name="chatty", code=CHATTY)
    alice.call("/alice/chatty/ok")

    def lost():
        call_records_collect(runtime=get_runtime())
        return logs(alice, "alice--chatty").json()["lost"]

    assert wait_for(lost, timeout=30, interval=0.2, message="the lost record counted") == 1
    assert logs(alice, "alice--chatty").json()["records"] == []
