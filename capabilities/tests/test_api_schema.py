"""The control API fuzzed from its own OpenAPI schema (/_api/schema) with schemathesis:
whatever it is sent, it never answers 5xx, and every answer is one the schema documents
(status, content type, body shape)."""

import re

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from testsupport.capability_code import PONG

# Bounded so that the run takes about a minute: examples per operation.
MAX_EXAMPLES = 250


@pytest.fixture
def api_schema(alice, settings):
    # The fuzzer's invalid-credential probes are guesses the failed-token brake would stop
    # with a 429 after 20; the brake has tests of its own (sigil_site/tests/test_abuse.py).
    settings.SIGIL_AUTH_FAILURE_LIMIT = 0
    assert alice.deploy(name="ping", code=PONG).status_code == 201  # something to list and inspect
    return schemathesis.openapi.from_url(f"{alice.base_url}/_api/schema")


# The control API only: the call route answers whatever a capability answers, and /metrics
# is Prometheus text behind its own token; both are documented for readers, and tested
# where they are served (test_invoke.py, test_metrics.py). The live tail of call records
# streams for as long as it is asked to (test_call_logs.py).
schema = (
    schemathesis.pytest.from_fixture("api_schema")
    .exclude(tag=["Call"])
    .exclude(path="/metrics")
    .exclude(path="/_api/capabilities/{full}/logs/tail")
)


@pytest.mark.slow
@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_the_api_answers_as_its_schema_says(case, alice):
    with requests.Session() as session:
        case.call_and_validate(
            session=session,
            headers={"Authorization": f"Bearer {alice.deploy_token}"},
            checks=[
                not_a_server_error,
                status_code_conformance,
                content_type_conformance,
                response_schema_conformance,
                ignored_auth,
            ],
        )


def test_mcp_refusals_and_full_names_are_as_the_schema_says(api_schema, alice):
    """Outside the fuzzing above (the Call tag): what /_mcp refuses before any JSON-RPC is
    answered in the shape its schema documents, and a `{full}` name carries its rule."""
    mcp = api_schema["/_mcp"]["POST"]
    url = f"{alice.base_url}/_mcp"
    not_json = requests.post(url, data="x", headers={"Content-Type": "text/plain", **alice.headers(alice.invoke_token)})
    no_token = requests.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    for response, status in ((not_json, 415), (no_token, 401)):
        assert response.status_code == status, response.text
        mcp.validate_response(response)
        assert isinstance(response.json()["error"]["code"], int)

    described = requests.get(f"{alice.base_url}/_api/schema", headers={"Accept": "application/json"}).json()
    (full,) = [p for p in described["paths"]["/_api/capabilities/{full}"]["get"]["parameters"] if p["name"] == "full"]
    pattern = re.compile(full["schema"]["pattern"])
    assert pattern.search("alice--ping") and not pattern.search("alice-ping") and not pattern.search("Alice--ping")
