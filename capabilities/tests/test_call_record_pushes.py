"""The origin's endpoint for call records pushed by Sigil's Workers on Cloudflare
(`POST /_call-records`): a signed batch is kept once, whatever pushes it again; a bad or stale
signature, or a body that is no batch, is refused in the error envelope and keeps nothing."""

import json
import time
import uuid

import pytest
import requests

from capabilities.books import call_logs
from capabilities.log_limits import LogLimits
from capabilities.record_pushes import (
    MAX_AGE_SECONDS,
    PUSH_PATH,
    SIGNATURE_HEADER,
    SIGNED_AT_HEADER,
    push_key,
    push_signature,
)
from sigil import redis_keys


def a_record(request_id: str) -> dict:
    """One record as the loader host's tail shapes it."""
    return {
        "capability": "alice--chatty",
        "sha": "",
        "request_id": request_id,
        "at": time.time(),
        "outcome": "ok",
        "status": 200,
        "logs": [{"level": "log", "at": time.time(), "text": "hello", "cut": False}],
    }


def signed(body: bytes, *, key: str | None = None, signed_at: float | None = None) -> dict[str, str]:
    """The headers a Worker signs `body` with (with `key`, at `signed_at`)."""
    from django.conf import settings

    at = str(int(time.time() if signed_at is None else signed_at))
    signature = push_signature(key=key or push_key(settings.SIGIL_INTERNAL_SECRET), signed_at=at, body=body)
    return {"Content-Type": "application/json", SIGNED_AT_HEADER: at, SIGNATURE_HEADER: signature}


def push(sigil, body: bytes, *, headers: dict[str, str] | None = None, **signing) -> requests.Response:
    """POST `body` to the origin with `headers`, by default those of a Worker signing it."""
    sent = signed(body, **signing) if headers is None else headers
    return requests.post(f"{sigil.url}/{PUSH_PATH}", data=body, headers=sent, timeout=10)


def kept(redis_client) -> list[str]:
    return [json.loads(raw)["request_id"] for raw in redis_client.lrange(redis_keys.logs("alice--chatty"), 0, -1)]


def test_a_batch_pushed_twice_is_kept_once(sigil, settings, redis_client):
    body = json.dumps({"id": str(uuid.uuid4()), "records": [a_record("r1"), a_record("r2")], "dropped": 2}).encode()
    assert push(sigil, body).status_code == 204
    assert push(sigil, body).status_code == 204  # taken before: success, and nothing more
    assert sorted(kept(redis_client)) == ["r1", "r2"]
    assert call_logs.call_records_undelivered_count() == 2  # its `dropped`, counted once
    settings.SIGIL_METRICS_TOKEN = "scrape"
    metrics = requests.get(f"{sigil.url}/metrics", headers={"Authorization": "Bearer scrape"}, timeout=10).text
    assert 'sigil_call_record_pushes_total{taken="first"} 1.0' in metrics
    assert 'sigil_call_record_pushes_total{taken="again"} 1.0' in metrics

    another = json.dumps({"id": str(uuid.uuid4()), "records": [a_record("r1")]}).encode()
    assert push(sigil, another).status_code == 204  # another batch is another batch
    assert sorted(kept(redis_client)) == ["r1", "r1", "r2"]


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("another key", "does not match"),
        ("another body", "does not match"),
        ("stale", "signed"),
        ("ahead", "signed"),
        ("no time", "says when it was signed"),
    ],
)
def test_a_push_without_a_good_fresh_signature_is_refused_and_keeps_nothing(sigil, redis_client, how, words):
    body = json.dumps({"id": str(uuid.uuid4()), "records": [a_record("forged")], "dropped": 5}).encode()
    if how == "another key":
        answer = push(sigil, body, key=push_key("another installation's secret"))
    elif how == "another body":
        answer = push(sigil, body, headers=signed(json.dumps({"id": str(uuid.uuid4()), "records": []}).encode()))
    elif how == "stale":
        answer = push(sigil, body, signed_at=time.time() - MAX_AGE_SECONDS - 60)
    elif how == "ahead":
        answer = push(sigil, body, signed_at=time.time() + MAX_AGE_SECONDS + 60)
    else:
        answer = push(sigil, body, headers={**signed(body), SIGNED_AT_HEADER: "yesterday"})
    assert answer.status_code == 403
    error = answer.json()["error"]
    assert error["code"] == "forbidden" and words in error["message"]
    assert kept(redis_client) == []
    assert call_logs.call_records_undelivered_count() == 0
    assert call_logs.call_records_pushes() == (0, 0)


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"records": "none"}', json.dumps({"records": [{"capability": "alice--chatty"}]}).encode()],
    ids=["not JSON", "no records", "no id"],
)
def test_a_signed_body_that_is_no_batch_is_refused(sigil, redis_client, body):
    answer = push(sigil, body)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_request"
    assert kept(redis_client) == [] and call_logs.call_records_pushes() == (0, 0)


def test_a_batch_past_the_bound_is_refused_before_it_is_read(sigil, settings, redis_client):
    settings.SIGIL_LOGS_LINES_PER_CALL = 1
    settings.SIGIL_LOGS_LINE_BYTES = 10
    bound = LogLimits.from_settings().batch_bytes
    records = [{**a_record(f"r{i}"), "logs": [{"text": "x" * 600}]} for i in range(1 + bound // 600)]
    answer = push(sigil, json.dumps({"id": str(uuid.uuid4()), "records": records}).encode())
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "too_large"
    assert kept(redis_client) == []


def test_the_origin_answers_only_a_post(sigil):
    answer = requests.get(f"{sigil.url}/{PUSH_PATH}", timeout=10)
    assert answer.status_code == 405 and answer.headers["Allow"] == "POST"
    assert answer.json()["error"]["code"] == "invalid_request"
