"""Deploy and call capabilities end to end: HTTP to Sigil, real workerd running the code."""

import pytest

from capabilities.models import CapabilityVersion
from testsupport.capability_code import COUNTS_BODY, PONG, PONG2, STREAMS
from testsupport.cast import call_echo_with_everything


def test_deploy_then_invoke_then_new_version_then_invoke(alice):
    created = alice.deploy(name="ping", code=PONG)
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["capability"] == "alice--ping"
    assert body["version"] == 1
    assert body["url"].endswith("/alice/ping")
    assert body["cold_start"] is False and body["evicted"] is None and body["expires_at"] is None

    first = alice.call("/alice/ping")
    assert first.status_code == 200 and first.text == "pong"
    assert first.headers["X-Sigil-Capability"] == "alice--ping"
    assert "sigil;dur=" in first.headers["Server-Timing"]

    updated = alice.deploy(name="ping", code=PONG2)
    assert updated.status_code == 200 and updated.json()["version"] == 2
    assert alice.call("/alice/ping").text == "pong v2"
    assert list(
        CapabilityVersion.objects.filter(capability__full_name="alice--ping").values_list("number", flat=True)
    ) == [2, 1]


def test_deploy_of_same_code_makes_no_new_version(alice):
    alice.deploy(name="ping", code=PONG)
    again = alice.deploy(name="ping", code=PONG)
    assert again.status_code == 200
    assert again.json()["version"] == 1
    assert CapabilityVersion.objects.filter(capability__full_name="alice--ping").count() == 1


def test_method_path_query_headers_and_body_pass_through(alice):
    response = call_echo_with_everything(alice)
    assert response.status_code == 207
    assert response.headers["x-echo"] == "yes"
    assert response.headers["set-cookie"] == "a=b"
    seen = response.json()
    assert seen["method"] == "PUT"
    assert seen["path"] == "/deep/path%20x"
    assert seen["query"] == "?q=1&r=two"
    assert seen["body"] == "payload-bytes"
    assert seen["headers"]["x-custom"] == "value"
    assert seen["headers"]["content-type"] == "text/plain"
    assert "authorization" not in seen["headers"]
    assert not [h for h in seen["headers"] if h.startswith("x-sigil")]


def test_capability_that_throws_answers_in_the_envelope(alice):
    alice.deploy(name="boom", code="export default { async fetch() { throw new Error('kaput') } }")
    response = alice.call("/alice/boom")
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "capability_error"
    assert "kaput" in error["message"]


def test_response_body_streams_to_the_caller(alice):
    import time

    alice.deploy(name="streams", code=STREAMS)
    started = time.monotonic()
    response = alice.call("/alice/streams", stream=True)
    first = response.raw.read(len(b"first;"))
    first_at = time.monotonic() - started
    rest = response.raw.read()
    assert first == b"first;" and rest == b"second"
    assert first_at < 1.0  # the first chunk arrived before the capability finished


def test_large_request_body_reaches_the_capability(alice):
    alice.deploy(name="counts", code=COUNTS_BODY)
    payload = b"x" * (8 * 1024 * 1024)
    response = alice.call("/alice/counts", method="POST", data=payload)
    assert response.status_code == 200 and response.text == str(len(payload))


def test_request_body_over_the_invoke_limit_is_a_413(alice, settings):
    settings.SIGIL_INVOKE_MAX_BODY_BYTES = 1024
    alice.deploy(name="counts", code=COUNTS_BODY)
    response = alice.call("/alice/counts", method="POST", data=b"x" * 2048)
    assert response.status_code == 413 and response.json()["error"]["code"] == "too_large"


@pytest.mark.parametrize("path", ["/alice", "/alice/", "/Alice/ping", "/alice/no--such", "/alice/missing"])
def test_paths_that_name_no_capability_are_404(alice, path):
    response = alice.call(path)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_each_call_leaves_one_json_access_line(alice, caplog):
    import json
    import logging

    from sigil.logs import SigilFormatter

    alice.deploy(name="ping", code=PONG)
    with caplog.at_level(logging.INFO, logger="sigil.access"):
        assert alice.call("/alice/ping").status_code == 200
        assert alice.call("/alice/missing").status_code == 404
    json_lines = SigilFormatter(kind="json")
    lines = [json.loads(json_lines.format(r)) for r in caplog.records if r.name == "sigil.access"]
    assert all(line["time"].endswith("Z") and line["level"] == "INFO" for line in lines)
    assert [(line["path"], line["status"], line["capability"], line["cold"]) for line in lines] == [
        ("/alice/ping", 200, "alice--ping", False),
        ("/alice/missing", 404, None, False),
    ]
    assert all(line["ms"] > 0 for line in lines)
