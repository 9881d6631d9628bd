"""The control API fuzzed from its own OpenAPI schema (/_api/schema) with schemathesis:
whatever it is sent, it never answers 5xx, and every answer is one the schema documents
(status, content type, body shape)."""

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
# where they are served (test_invoke.py, test_metrics.py).
schema = schemathesis.pytest.from_fixture("api_schema").exclude(tag=["Call"]).exclude(path="/metrics")


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
