"""Bad requests of every kind, each with the status and error code it must get, sent to Sigil
over HTTP. Whatever the input, the answer is the contract's envelope (never a 5xx), written
with `nosniff`, and a 401 names the Bearer scheme."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import requests

from capabilities.models import Capability
from testsupport.capability_code import PONG

DEEP = b"[" * 100_000 + b"]" * 100_000
NESTED_BINDINGS = json.loads("[" * 33 + '"VAR:A"' + "]" * 33)
BASIC = {"Authorization": "Basic YTpi"}
EMPTY_BEARER = {"Authorization": "Bearer "}


@dataclass(frozen=True)
class Bad:
    """One hostile request: what is sent, and what must come back."""

    id: str
    status: int
    code: str
    method: str = "POST"
    path: str = "/_api/deploy"
    token: str | None = "deploy"  # deploy, invoke, revoked, unknown, or None (no header)
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    settings: dict[str, int] = field(default_factory=dict)


def deploy(**fields) -> bytes:
    return json.dumps({"name": "ping", "code": PONG} | fields).encode()


TABLE = [
    # Bodies
    Bad("json nested 100,000 deep", 400, "invalid_request", body=DEEP),
    Bad(
        "json nested deep in a field",
        400,
        "invalid_request",
        body=deploy(bindings=[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["VAR:A"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]),
    ),
    Bad("not json", 400, "invalid_request", body=b'{"name": "ping",'),
    Bad("a json array", 400, "invalid_request", body=b"[]"),
    Bad("a json string", 400, "invalid_request", body=b'"ping"'),
    Bad("NaN", 400, "invalid_request", body=b'{"name": "ping", "code": NaN}'),
    Bad("not utf-8", 400, "invalid_request", body=b'{"name": "\xff\xfe"}'),
    Bad("empty body", 400, "invalid_request", body=b""),
    Bad("unknown field", 400, "invalid_request", body=deploy(owner="root")),
    Bad("ttl as a string", 400, "invalid_request", body=deploy(ttl="3600")),
    Bad("public as a string", 400, "invalid_request", body=deploy(public="yes")),
    Bad("bindings not a list", 400, "invalid_request", body=deploy(bindings="VAR:A")),
    Bad("body over the limit", 413, "too_large", body=deploy(), settings={"SIGIL_DEPLOY_MAX_BODY_BYTES": 40}),
    # Headers
    Bad("form content type", 415, "invalid_request", body=b"name=ping", headers={"Content-Type": "text/plain"}),
    Bad("no authorization", 401, "unauthenticated", token=None, body=deploy()),
    Bad(
        "basic authorization",
        401,
        "unauthenticated",
        token=None,
        body=deploy(),
        headers=BASIC,
    ),
    Bad(
        "bearer without a token",
        401,
        "unauthenticated",
        token=None,
        body=deploy(),
        headers=EMPTY_BEARER,
    ),
    Bad("invoke scope deploys", 403, "forbidden", token="invoke", body=deploy()),
    Bad("unsupported method", 405, "invalid_request", method="PUT", body=deploy()),
    Bad("unknown API path", 404, "not_found", method="GET", path="/_api/nothing-here"),
    # Names: taken exactly as sent
    Bad("name with a leading space", 400, "invalid_request", body=deploy(name=" ping")),
    Bad("name with a trailing space", 400, "invalid_request", body=deploy(name="ping ")),
    Bad("name with a newline", 400, "invalid_request", body=deploy(name="ping\n")),
    Bad("name in capitals", 400, "invalid_request", body=deploy(name="PING")),
    Bad("name with a NUL", 400, "invalid_request", body=deploy(name="pi\u0000ng")),
    Bad("name not ascii", 400, "invalid_request", body=deploy(name="pi\u00f1g")),
    Bad("name a number", 400, "invalid_request", body=deploy(name=42)),
    Bad("name too long", 400, "invalid_request", body=deploy(name="p" * 42)),
    Bad("agent with a space", 403, "forbidden", body=deploy(agent=" alice")),
    Bad("binding with a space", 400, "invalid_request", body=deploy(bindings=[" VAR:A"])),
    Bad("full name with a space", 400, "invalid_request", method="GET", path="/_api/capabilities/alice--%20ping"),
    Bad("call of a name with a space", 404, "not_found", method="GET", path="/alice/%20ping", token="invoke"),
    Bad("call of a path with dots", 404, "not_found", method="GET", path="/alice/..%2f..%2fadmin", token="invoke"),
    # Tokens
    Bad("unknown token on the API", 401, "unauthenticated", token="unknown", body=deploy()),
    Bad("revoked token on the API", 401, "unauthenticated", token="revoked", body=deploy()),
    Bad("unknown token on a call", 401, "unauthenticated", method="GET", path="/alice/ping", token="unknown"),
    Bad("revoked token on a call", 401, "unauthenticated", method="GET", path="/alice/ping", token="revoked"),
    Bad("no token on a call", 401, "unauthenticated", method="GET", path="/alice/ping", token=None),
    Bad("no token on the list", 401, "unauthenticated", method="GET", path="/_api/capabilities", token=None),
    # Codes
    Bad("empty code", 400, "invalid_request", body=deploy(code="")),
    Bad("code not a string", 400, "invalid_request", body=deploy(code=["export default {}"])),
    Bad("code 0", 400, "invalid_request", body=deploy(code="0")),
    Bad("code without fetch", 400, "invalid_request", body=deploy(code="export default {}")),
    Bad("code not a module", 400, "invalid_request", body=deploy(code="addEventListener('fetch', () => {})")),
    Bad("code that does not parse", 400, "invalid_request", body=deploy(code="export default {")),
    Bad("code over the limit", 413, "too_large", body=deploy(), settings={"SIGIL_SCRIPT_MAX_BYTES": 10}),
]


@pytest.fixture
def tokens(alice):
    from agents import services
    from agents.models import Agent

    _, revoked = services.token_issue(agent=Agent.objects.get(name="alice"), scope="deploy", actor="owner:test")
    token = Agent.objects.get(name="alice").tokens.order_by("-pk").first()
    services.token_revoke(token=token, actor="owner:test")
    return {
        "deploy": alice.deploy_token,
        "invoke": alice.invoke_token,
        "revoked": revoked,
        "unknown": "sgl_" + "x" * 43,
    }


@pytest.mark.parametrize("bad", TABLE, ids=[bad.id for bad in TABLE])
def test_a_bad_request_gets_its_status_and_code(alice, tokens, settings, bad):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    for name, value in bad.settings.items():
        setattr(settings, name, value)
    headers = {"Content-Type": "application/json"}
    if bad.token is not None:
        headers["Authorization"] = f"Bearer {tokens[bad.token]}"
    headers.update(bad.headers)
    response = requests.request(bad.method, alice.base_url + bad.path, data=bad.body, headers=headers, timeout=30)

    assert (response.status_code, response.headers.get("Content-Type")) == (bad.status, "application/json"), (
        response.text[:500]
    )
    assert response.json()["error"]["code"] == bad.code
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    if bad.status == 401:
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert set(Capability.objects.values_list("full_name", flat=True)) == {"alice--ping"}


def test_the_admin_sends_a_content_security_policy_and_nosniff(sigil):
    login = requests.get(f"{sigil.url}/admin/login/", timeout=30)
    assert login.status_code == 200
    policy = login.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert login.headers["X-Content-Type-Options"] == "nosniff"
    # The API's JSON needs no policy; it still says what it is.
    health = requests.get(f"{sigil.url}/_health", timeout=30)
    assert "Content-Security-Policy" not in health.headers
    assert health.headers["X-Content-Type-Options"] == "nosniff"
