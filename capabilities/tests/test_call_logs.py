"""A call's record for its capability's owner: console lines, uncaught exception and outcome,
from the runtime's own tail events, by the call's X-Request-Id; bounded, secrets masked."""

import json

import pytest

from capabilities.books import call_logs
from capabilities.log_limits import LogLimits
from capabilities.models import Binding
from sigil import redis_keys
from sigil.encryption import secret_encrypt
from testsupport.cast import grant, wait_for

CHATTY = """export default { async fetch(request, env) {
  console.debug('debugging', 1);
  console.info('starting', { path: new URL(request.url).pathname });
  console.log('plain');
  console.warn('careful');
  console.error('it went wrong');
  if (new URL(request.url).pathname.endsWith('/boom')) throw new TypeError('exploded here');
  return new Response('fine');
} }"""

# What CHATTY writes on /ok, as its record holds it.
CHATTY_LINES = [
    ("debug", "debugging 1"),
    ("info", 'starting {"path":"/ok"}'),
    ("log", "plain"),
    ("warn", "careful"),
    ("error", "it went wrong"),
]

LEAKS = """export default { async fetch(request, env) {
  console.log('the token is', env.TOKEN, 'and again:' + env.TOKEN);
  throw new Error('failed with ' + env.TOKEN);
} }"""

FLOODS = """export default { async fetch() {
  for (let i = 0; i < 250; i++) console.log('line ' + i);
  console.error('x'.repeat(5000));
  return new Response('flooded');
} }"""


def logs(agent, full, **query):
    return agent.session.get(
        f"{agent.base_url}/_api/capabilities/{full}/logs", params=query, headers=agent.headers(agent.invoke_token)
    )


def record_of(agent, full, request_id, *, timeout: float = 10):
    """The call's record, once its tail has handed it over."""

    def found():
        answer = logs(agent, full, request_id=request_id)
        assert answer.status_code == 200, answer.text
        return answer.json()["records"]

    [record] = wait_for(found, timeout=timeout, message=f"the record of {request_id}")
    return record


def test_a_capability_that_logs_and_throws_has_both_calls_recorded_by_request_id(alice, bob):
    alice.deploy(name="chatty-once", code=CHATTY, public=True)
    fine = alice.call("/alice/chatty-once/ok")
    boom = alice.call("/alice/chatty-once/boom")
    assert fine.status_code == 200 and boom.status_code == 502

    ok = record_of(alice, "alice--chatty-once", fine.headers["X-Request-Id"])
    assert [(line["level"], line["text"]) for line in ok["logs"]] == CHATTY_LINES
    assert (ok["outcome"], ok["status"], ok["exception"], ok["version"]) == ("ok", 200, None, 1)
    # A name no other test deploys: its isolate is new in the agent's workerd.
    assert ok["cold"] is True and ok["wall_ms"] is not None

    failed = record_of(alice, "alice--chatty-once", boom.headers["X-Request-Id"])
    assert failed["outcome"] == "exception" and failed["status"] is None
    assert (failed["exception"]["name"], failed["exception"]["message"]) == ("TypeError", "exploded here")
    assert "main.js" in failed["exception"]["stack"]
    assert failed["cold"] is False and len(failed["logs"]) == 5

    # Newest first; the error filter finds the failed call and the one that logged an error.
    every = logs(alice, "alice--chatty-once").json()
    assert [r["request_id"] for r in every["records"]] == [boom.headers["X-Request-Id"], fine.headers["X-Request-Id"]]
    assert every["lost"] == 0 and every["next"] is None
    paged = logs(alice, "alice--chatty-once", limit=1).json()
    assert len(paged["records"]) == 1 and paged["next"]
    older = alice.session.get(paged["next"], headers=alice.headers(alice.invoke_token)).json()
    assert [r["request_id"] for r in older["records"]] == [fine.headers["X-Request-Id"]]

    # bob may call the public capability, not read what it said.
    assert bob.call("/alice/chatty-once/ok").status_code == 200
    refused = logs(bob, "alice--chatty-once")
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"
    assert logs(alice, "bob--nothing").status_code == 404


def test_a_bound_secret_logged_or_thrown_by_the_code_is_kept_as_its_name(alice, redis_client):
    grant(Binding.objects.create(kind="SECRET", name="TOKEN", secret_encrypted=secret_encrypt("hunter2-xyz")), "alice")
    alice.deploy(name="leaky", code=LEAKS, bindings=["SECRET:TOKEN"])
    answer = alice.call("/alice/leaky")
    record = record_of(alice, "alice--leaky", answer.headers["X-Request-Id"])

    assert record["logs"][0]["text"] == "the token is [secret TOKEN] and again:[secret TOKEN]"
    assert record["exception"]["message"] == "failed with [secret TOKEN]"
    stored = b"".join(redis_client.lrange(redis_keys.logs("alice--leaky"), 0, -1))
    assert b"[secret TOKEN]" in stored and b"hunter2-xyz" not in stored


def test_lines_past_the_bounds_are_cut_and_the_record_says_so(alice):
    alice.deploy(name="floods", code=FLOODS)
    answer = alice.call("/alice/floods")
    record = record_of(alice, "alice--floods", answer.headers["X-Request-Id"])

    assert len(record["logs"]) == 200 and record["lines_cut"] == 51  # SIGIL_LOGS_LINES_PER_CALL
    assert record["logs"][-1]["text"] == "line 199"
    assert record["lines_shortened"] == 0  # the long line was past the count


@pytest.fixture
def small():
    return LogLimits(
        lines_per_call=3, line_bytes=10, records_per_capability=3, retention_seconds=3600, agent_bytes=2000
    )


def raw_record(full, request_id, *, lines=1, text="hello"):
    return {
        "capability": full,
        "request_id": request_id,
        "at": 1e10,  # far ahead: never past the retention in these tests
        "outcome": "ok",
        "logs": [{"level": "log", "at": 1e10, "text": text} for _ in range(lines)],
    }


def test_the_store_keeps_the_newest_records_of_each_capability_within_its_bounds(small, redis_client):
    kept = call_logs.call_records_keep(
        records=[raw_record("alice--a", f"r{i}", lines=5, text="x" * 30) for i in range(5)], limits=small
    )
    assert kept == 5
    page = call_logs.call_records_list(full="alice--a", retention_seconds=10**11)
    assert [r["request_id"] for r in page.records] == ["r4", "r3", "r2"]  # records per capability
    record = page.records[0]
    assert (len(record["logs"]), record["lines_cut"], record["lines_shortened"]) == (3, 2, 3)
    assert record["logs"][0] == {"level": "log", "at": 1e10, "text": "x" * 10, "cut": True}


def test_a_staged_version_in_traffic_keeps_its_records_under_its_capability(small, redis_client):
    assert call_logs.call_records_keep(records=[raw_record("alice--a--v2", "staged")], limits=small) == 1
    page = call_logs.call_records_list(full="alice--a", retention_seconds=10**11)
    assert [r["request_id"] for r in page.records] == ["staged"]


def test_one_capability_filling_its_agents_bytes_drops_its_own_records_never_a_siblings(small, redis_client):
    call_logs.call_records_keep(records=[raw_record("alice--quiet", "q1")], limits=small)
    for i in range(40):
        call_logs.call_records_keep(records=[raw_record("alice--loud", f"l{i}", lines=3, text="y" * 10)], limits=small)
    quiet = call_logs.call_records_list(full="alice--quiet", retention_seconds=10**11)
    assert [r["request_id"] for r in quiet.records] == ["q1"]
    held = sum(int(v) for v in redis_client.hvals(redis_keys.logs_bytes("alice")))
    assert held <= small.agent_bytes

    # A record that cannot fit at all is lost, and counted.
    tiny = LogLimits(**{**small.__dict__, "agent_bytes": 50})
    assert call_logs.call_records_keep(records=[raw_record("bob--big", "b1")], limits=tiny) == 0
    assert call_logs.call_records_lost(full="bob--big") == 1
    assert call_logs.call_records_keep(records=[{"capability": "no name"}, "junk"], limits=small) == 0
    assert (call_logs.call_records_lost_kept(), call_logs.call_records_undelivered_count()) == (2, 1)


def test_records_not_kept_are_counted_in_metrics(sigil, settings, small, redis_client):
    import requests

    settings.SIGIL_METRICS_TOKEN = "scrape"
    tiny = LogLimits(**{**small.__dict__, "agent_bytes": 50})
    call_logs.call_records_keep(records=[raw_record("bob--big", "b1"), "junk"], limits=tiny)
    text = requests.get(f"{sigil.url}/metrics", headers={"Authorization": "Bearer scrape"}).text
    assert 'sigil_call_records_lost_total{why="not_kept"} 1.0' in text
    assert 'sigil_call_records_lost_total{why="undelivered"} 1.0' in text


def test_a_forged_batch_without_the_internal_secret_is_refused(workerd_group, redis_client):
    import requests

    [sink] = workerd_group.companions
    body = json.dumps({"records": [raw_record("alice--a", "forged")]})
    answer = requests.post(f"http://127.0.0.1:{sink.port}/records", data=body, headers={"X-Sigil-Secret": "guess"})
    assert answer.status_code == 403
    assert redis_client.exists(redis_keys.logs("alice--a")) == 0


def test_records_the_sink_refuses_are_counted_as_lost_for_their_capability(alice, workerd_group, redis_client):
    alice.deploy(name="chatty", code=CHATTY)
    [sink] = workerd_group.companions
    bound = sink.max_body
    sink.max_body = 10  # every batch is refused (413) until the bound is back
    try:
        refused = alice.call("/alice/chatty/ok").headers["X-Request-Id"]
        wait_for(lambda: call_logs.call_records_undelivered_count() >= 1, timeout=10, message="the batch refused")
    finally:
        sink.max_body = bound
    # The next batch that gets through says whose records were lost.
    after = alice.call("/alice/chatty/ok").headers["X-Request-Id"]
    record_of(alice, "alice--chatty", after)
    assert wait_for(lambda: logs(alice, "alice--chatty").json()["lost"], timeout=10, message="the loss counted") == 1
    assert [r["request_id"] for r in logs(alice, "alice--chatty").json()["records"]] == [after]
    assert refused != after


def test_a_removed_capability_takes_its_records_with_it(alice):
    alice.deploy(name="chatty", code=CHATTY)
    record_of(alice, "alice--chatty", alice.call("/alice/chatty").headers["X-Request-Id"])
    assert alice.call("/_api/capabilities/alice--chatty", method="DELETE", token="deploy").status_code == 204
    alice.deploy(name="chatty", code=CHATTY)
    assert logs(alice, "alice--chatty").json()["records"] == []


def test_the_live_tail_streams_a_new_calls_record_and_ends_when_its_time_is_up(alice, bob):
    import threading

    alice.deploy(name="chatty", code=CHATTY, public=True)
    url = f"{alice.base_url}/_api/capabilities/alice--chatty/logs/tail"
    headers = {**alice.headers(alice.invoke_token), "Accept": "text/event-stream"}
    bobs = {**bob.headers(bob.invoke_token), "Accept": "text/event-stream"}
    assert bob.session.get(url, headers=bobs).status_code == 404

    events = []
    with alice.session.get(url, params={"seconds": 3}, headers=headers, stream=True, timeout=20) as stream:
        assert stream.status_code == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
        # One byte at a time: a larger read waits for that many bytes (or the end).
        lines = stream.iter_lines(chunk_size=1, decode_unicode=True)
        assert next(lines) == ": following"  # on before the call is made
        called = threading.Thread(target=lambda: events.append(alice.call("/alice/chatty/boom")))
        called.start()
        for line in lines:
            if line.startswith("data: "):
                record = json.loads(line[len("data: ") :])
                break
        called.join()
        assert record["request_id"] == events[0].headers["X-Request-Id"]
        assert record["exception"]["message"] == "exploded here"
        rest = list(lines)  # it ends by itself, `seconds` after it began
    assert not any(line.startswith("data: ") for line in rest)


@pytest.mark.parametrize("mode", ["2026-07-28"])
def test_an_agent_reads_its_calls_records_over_mcp_and_another_agent_cannot(sigil, alice, bob, mode):
    from capabilities.tests.test_mcp import run

    alice.deploy(name="chatty", code=CHATTY, public=True)
    request_id = alice.call("/alice/chatty/boom").headers["X-Request-Id"]
    record_of(alice, "alice--chatty", request_id)

    async def steps(client):
        return await client.call_tool("sigil.logs", {"capability": "alice--chatty", "level": "error"})

    read = run(sigil, alice.deploy_token, mode, steps)
    assert not read.is_error, read.content[0].text
    [record] = read.structured_content["records"]
    assert record["request_id"] == request_id and record["exception"]["name"] == "TypeError"
    refused = run(sigil, bob.deploy_token, mode, steps)
    assert refused.is_error and refused.content[0].text.startswith("not_found")


def test_the_owner_reads_and_follows_a_capabilitys_records_with_manage_py_logs(alice):
    import io
    import threading

    from django.core.management import call_command

    alice.deploy(name="chatty", code=CHATTY)
    first = alice.call("/alice/chatty/boom").headers["X-Request-Id"]
    record_of(alice, "alice--chatty", first)
    out = io.StringIO()
    call_command("logs", "alice--chatty", stdout=out)
    text = out.getvalue()
    assert f"{first} exception - v1 " in text
    assert "  [warn] careful" in text and "  ! TypeError: exploded here" in text

    followed = io.StringIO()
    follow = threading.Thread(
        target=call_command, args=("logs", "alice--chatty", "--follow", "--for", "8"), kwargs={"stdout": followed}
    )
    follow.start()
    wait_for(lambda: first in followed.getvalue(), message="the latest record printed first")
    second = alice.call("/alice/chatty/ok").headers["X-Request-Id"]
    wait_for(lambda: second in followed.getvalue(), message="the new call's record followed")
    follow.join(20)
    assert not follow.is_alive()
    assert f"{second} ok 200 v1 warm" in followed.getvalue()


def test_the_owner_sees_the_records_on_the_capabilitys_page_and_a_failure_links_to_its_own(sigil, owner, alice):
    from capabilities.models import Capability
    from testsupport.browser import screenshot

    page = owner
    alice.deploy(name="chatty", code=CHATTY)
    fine = alice.call("/alice/chatty/ok").headers["X-Request-Id"]
    boom = alice.call("/alice/chatty/boom").headers["X-Request-Id"]
    record_of(alice, "alice--chatty", boom)
    record_of(alice, "alice--chatty", fine)
    capability = Capability.objects.get(full_name="alice--chatty")

    page.goto(f"{sigil.url}/admin/capabilities/capability/{capability.pk}/change/")
    page.locator(f"#record-{fine} .call-record-lines", has_text="[warn] careful").wait_for()
    page.locator(f"#record-{boom} .call-record-exception", has_text="TypeError: exploded here").wait_for()
    page.locator("#call-records-lost", has_text="None was lost").wait_for()
    screenshot(page, "capability-call-records")

    page.click(f"#recent-failures a:has-text('{boom}')")
    page.locator(f"#record-{boom}").wait_for()
    assert page.locator("#call-records .call-record").count() == 1

    page.select_option("select[name=logs_level]", "warn")
    page.fill("input[name=logs_request]", "")
    page.click("#call-records input[type=submit]")
    page.locator(f"#record-{fine}").wait_for()
    assert page.locator("#call-records .call-record").count() == 2


def test_on_the_loader_runtime_the_dynamic_workers_tail_pushes_records_to_the_origin(loader, alice, bob, cf_client):
    grant(Binding.objects.create(kind="SECRET", name="TOKEN", secret_encrypted=secret_encrypt("hunter2-xyz")), "alice")
    alice.deploy(name="chatty", code=CHATTY, public=True)
    alice.deploy(name="leaky", code=LEAKS, bindings=["SECRET:TOKEN"])
    fine = alice.call("/alice/chatty/ok").headers["X-Request-Id"]
    boom = alice.call("/alice/chatty/boom").headers["X-Request-Id"]
    leaked = alice.call("/alice/leaky").headers["X-Request-Id"]

    ok = record_of(alice, "alice--chatty", fine, timeout=30)
    assert [line["level"] for line in ok["logs"]] == ["debug", "info", "log", "warn", "error"]
    assert (ok["outcome"], ok["status"], ok["version"]) == ("ok", 200, 1)
    failed = record_of(alice, "alice--chatty", boom, timeout=30)
    assert failed["exception"]["message"] == "exploded here"
    masked = record_of(alice, "alice--leaky", leaked, timeout=30)
    assert masked["logs"][0]["text"] == "the token is [secret TOKEN] and again:[secret TOKEN]"
    assert logs(bob, "alice--chatty").status_code == 404

    # The origin took every batch: nothing waits in the host's namespace.
    from capabilities.runtimes import get_runtime

    assert not cf_client.kv_keys(get_runtime().kv_id, prefix="spool:")
