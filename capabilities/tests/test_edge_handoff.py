"""The mark Sigil's edge puts on a call it hands the origin: over HTTP to the origin (the test
server), signed as the edge signs it (calls the edge itself hands on are in test_edge.py)."""

import time

from agents.throttle import FailedAuthThrottle
from sigil.edge_handoff import MAX_SKEW_SECONDS, handoff_key, handoff_signature


def marked(settings, *, client: str, at: int, path: str = "/alice/ping", signature: str | None = None) -> dict:
    key = handoff_key(settings.SIGIL_INTERNAL_SECRET)
    signed = handoff_signature(key, at=str(at), client=client, method="GET", path=path)
    return {
        "X-Sigil-Edge": "1",
        "X-Sigil-Edge-Client": client,
        "X-Sigil-Edge-At": str(at),
        "X-Sigil-Edge-Signature": signed if signature is None else signature,
    }


def test_the_origin_takes_the_callers_address_from_the_edges_mark_only_when_it_verifies(
    alice, access_log, redis_client, settings
):
    now = int(time.time())
    bad_token = "sgl_not-a-token"
    trusted = alice.call("/alice/ping", token=bad_token, headers=marked(settings, client="203.0.113.7", at=now))
    forged = alice.call(
        "/alice/ping", token=bad_token, headers=marked(settings, client="203.0.113.8", at=now, signature="0" * 64)
    )
    elsewhere = alice.call(  # signed for another path
        "/alice/ping", token=bad_token, headers=marked(settings, client="203.0.113.9", at=now, path="/alice/other")
    )
    stale = alice.call(
        "/alice/ping", token=bad_token, headers=marked(settings, client="203.0.113.10", at=now - MAX_SKEW_SECONDS - 60)
    )
    assert {answer.status_code for answer in (trusted, forged, elsewhere, stale)} == {401}
    # A failed token counts against the address a valid mark names; else against the caller's own.
    assert redis_client.get(FailedAuthThrottle.key("203.0.113.7")) == b"1"
    assert redis_client.get(FailedAuthThrottle.key("127.0.0.1")) == b"3"
    logged = {line["request_id"]: line["edge"] for line in access_log()}
    assert [logged[answer.headers["X-Request-Id"]] for answer in (trusted, forged, elsewhere, stale)] == [
        True,
        False,
        False,
        False,
    ]
