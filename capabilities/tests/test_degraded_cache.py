"""A capability deployed with `"cache_when_degraded": true` answers a GET it answered before
from its last good response while its breaker is open; anything else is `503 degraded`."""

import time

from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.inflight import SERVER_REQUESTS

# Answers its path and query with a fresh stamp (so a cached answer shows as the old one),
# and throws on `?fail`.
STAMPED = """export default { async fetch(request) {
  const url = new URL(request.url);
  if (url.searchParams.has('fail')) throw new Error('down');
  return new Response(url.pathname + url.search + ' at ' + Date.now() + Math.random(),
    { headers: { 'x-mine': 'kept' } });
} }"""


def deploy_and_break(agent, settings, *, cache: bool | None) -> None:
    settings.SIGIL_BREAKER_THRESHOLD = 1
    body = {"name": "stamp", "code": STAMPED}
    if cache is not None:
        body["cache_when_degraded"] = cache
    assert agent.deploy(**body).status_code == 201


def stored() -> None:
    """Wait until the calls made so far have been recorded: the gateway stores an answer
    after it has sent it."""
    for server in SERVER_REQUESTS:
        assert server.wait_idle(timeout=10)


def open_breaker(agent) -> None:
    stored()
    assert agent.call("/alice/stamp/x?fail=1").status_code == 502
    refused = agent.call("/alice/stamp/never-called")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "degraded"


def test_a_degraded_capability_with_the_cache_answers_a_repeated_get_from_it(alice, settings):
    deploy_and_break(alice, settings, cache=True)
    first = alice.call("/alice/stamp/a?x=1")
    assert first.status_code == 200 and "X-Sigil-Cache" not in first.headers
    open_breaker(alice)

    cached = alice.call("/alice/stamp/a?x=1")
    assert cached.status_code == 200
    assert cached.text == first.text  # the stored answer, not a new one
    assert cached.headers["X-Sigil-Cache"] == "degraded" and cached.headers["x-mine"] == "kept"
    assert int(cached.headers["Age"]) >= 0
    # Another path or query, or another method, is refused as before.
    for path, method in (("/alice/stamp/b", "GET"), ("/alice/stamp/a?x=2", "GET"), ("/alice/stamp/a?x=1", "POST")):
        refused = alice.call(path, method=method)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "degraded", (path, method)


def test_without_the_option_a_degraded_capability_keeps_nothing_and_answers_503(alice, settings):
    deploy_and_break(alice, settings, cache=None)
    assert alice.call("/alice/stamp/a").status_code == 200
    assert not get_redis().exists(redis_keys.degraded_cache("alice--stamp"))
    open_breaker(alice)
    assert alice.call("/alice/stamp/a").status_code == 503


def test_a_cached_answer_past_its_maximum_age_is_not_served(alice, settings):
    settings.SIGIL_DEGRADED_CACHE_MAX_AGE_SECONDS = 1
    deploy_and_break(alice, settings, cache=True)
    assert alice.call("/alice/stamp/a").status_code == 200
    open_breaker(alice)
    assert alice.call("/alice/stamp/a").status_code == 200
    time.sleep(1.1)
    assert alice.call("/alice/stamp/a").status_code == 503


def test_the_cache_keeps_only_the_newest_answers_and_none_too_large(alice, settings):
    settings.SIGIL_DEGRADED_CACHE_MAX_ENTRIES = 2
    settings.SIGIL_DEGRADED_CACHE_MAX_BYTES = 60
    deploy_and_break(alice, settings, cache=True)
    for path in ("/alice/stamp/1", "/alice/stamp/2", "/alice/stamp/3", "/alice/stamp/" + "long" * 20):
        assert alice.call(path).status_code == 200
        stored()  # one after the other, so that "newest" is well defined
    open_breaker(alice)
    assert alice.call("/alice/stamp/1").status_code == 503  # pushed out by newer ones
    assert alice.call("/alice/stamp/2").status_code == 200
    assert alice.call("/alice/stamp/3").status_code == 200
    assert alice.call("/alice/stamp/" + "long" * 20).status_code == 503  # its body was over the limit


def test_a_redeploy_keeps_the_option_unless_it_turns_it_off(alice, settings):
    deploy_and_break(alice, settings, cache=True)
    assert alice.call("/alice/stamp/a").status_code == 200
    assert alice.deploy(name="stamp", code=STAMPED).status_code == 200  # omitted: kept
    assert alice.call("/_api/capabilities/alice--stamp").json()["cache_when_degraded"] is True
    assert alice.deploy(name="stamp", code=STAMPED, cache_when_degraded=False).status_code == 200
    assert alice.call("/_api/capabilities/alice--stamp").json()["cache_when_degraded"] is False
    open_breaker(alice)
    assert alice.call("/alice/stamp/a").status_code == 503


def test_a_string_for_the_flag_is_refused(alice):
    response = alice.deploy(name="stamp", code=STAMPED, cache_when_degraded="yes")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"
