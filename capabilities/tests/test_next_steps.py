"""What an agent author meets on the way: errors that say what to do next, the one 202 shape,
CORS on the control API, /llms.txt, and a capability's `inactive_at`; over HTTP against Sigil
served on loopback (and a real browser for CORS)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from django.utils import timezone

from agents import services as agent_services
from agents import tokens
from agents.models import Agent, Token
from capabilities.models import Capability
from capabilities.services import capability_mark_inactive
from capabilities.tests.test_async_calls import SLOW, result_of
from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.capability_code import PONG

DEPLOY_BODY = json.dumps({"name": "ping", "code": PONG})


def error_of(response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    return response.json()["error"]["message"]


def test_a_body_without_the_json_content_type_is_a_415_naming_application_json(alice):
    url = f"{alice.base_url}/_api/deploy"
    headers = alice.headers(alice.deploy_token)

    missing = requests.post(url, data=DEPLOY_BODY, headers=headers, timeout=30)
    wrong = requests.post(url, data=DEPLOY_BODY, headers={**headers, "Content-Type": "text/plain"}, timeout=30)

    # Some WSGI servers (the tests' among them) give a request without one text/plain, as
    # CGI does; granian gives none. Either way the answer says what to send.
    assert error_of(missing, 415).startswith("send the body as JSON with Content-Type: application/json (")
    assert error_of(wrong, 415) == (
        'send the body as JSON with Content-Type: application/json (this request has Content-Type "text/plain")'
    )
    assert missing.json()["error"]["code"] == "invalid_request"
    assert not Capability.objects.exists()


def test_the_apis_401_names_the_header_to_send(alice):
    answer = requests.get(f"{alice.base_url}/_api/capabilities", timeout=30)
    assert "Authorization: Bearer <token>" in error_of(answer, 401)
    assert answer.json()["error"]["code"] == "unauthenticated"
    assert answer.headers["WWW-Authenticate"] == 'Bearer realm="sigil"'


def test_a_disabled_agents_tokens_are_told_the_owner_disabled_the_agent(alice):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    agent = Agent.objects.get(name="alice")
    _, revoked = agent_services.token_issue(agent=agent, scope="invoke", actor="owner:test")
    agent_services.token_revoke(token=Token.objects.get(secret_hash=tokens.hash_secret(revoked)), actor="owner:test")

    agent_services.agent_set_active(agent=agent, is_active=False, actor="owner:test")

    def refusals(secret: str) -> list[str]:
        listing = requests.get(f"{alice.base_url}/_api/capabilities", headers=alice.headers(secret), timeout=30)
        call = alice.call("/alice/ping", token=secret)
        mcp = requests.post(
            f"{alice.base_url}/_mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
            headers={**alice.headers(secret), "Accept": "application/json, text/event-stream"},
            timeout=30,
        )
        assert mcp.status_code == 401, mcp.text
        return [error_of(listing, 401), error_of(call, 401), json.dumps(mcp.json())]

    disabled = "the owner disabled this token's agent"
    for message in refusals(alice.deploy_token):
        assert disabled in message, message
    # Read again from the database once the cached refusal is gone: still said so.
    get_redis().delete(redis_keys.token(tokens.hash_secret(alice.invoke_token)))
    for message in refusals(alice.invoke_token):
        assert disabled in message, message
    # A token revoked before stays plainly revoked.
    for message in refusals(revoked):
        assert "unknown, revoked or expired" in message and disabled not in message, message

    agent_services.agent_set_active(agent=agent, is_active=True, actor="owner:test")
    assert alice.call("/alice/ping").text == "pong"


def test_an_async_call_not_yet_run_answers_the_one_202_shape_at_its_status_url(alice, celery_worker):
    # The capability takes 2.5 s to answer: its status URL is read well before it has.
    assert alice.deploy(name="slow", code=SLOW).status_code == 201
    accepted = alice.call("/alice/slow", headers={"Prefer": "respond-async"})
    assert accepted.status_code == 202, accepted.text
    status_url = accepted.json()["status_url"]

    pending = alice.call(status_url)

    assert pending.status_code == 202, pending.text
    body = pending.json()
    assert body["status"] in ("accepted", "running")
    assert body == {
        "status": body["status"],
        "callback": status_url,
        "eta_seconds": 1,
        "call": status_url.rsplit("/", 1)[1],
        "capability": "alice--slow",
        "status_url": status_url,
    }
    assert pending.headers["Retry-After"] == "1"
    assert result_of(alice, status_url).text.startswith("slow")


def test_a_cors_preflight_to_the_api_is_answered_without_a_token_and_the_answer_is_readable(alice):
    url = f"{alice.base_url}/_api/deploy"
    origin = {"Origin": "https://agents.example.com"}
    preflight = requests.options(
        url,
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=30,
    )
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert preflight.headers["Access-Control-Allow-Headers"] == "Authorization, Content-Type"
    assert preflight.headers["X-Content-Type-Options"] == "nosniff"

    deployed = alice.session.post(
        url, json={"name": "ping", "code": PONG}, headers={**origin, **alice.headers(alice.deploy_token)}, timeout=30
    )
    assert deployed.status_code == 201
    assert deployed.headers["Access-Control-Allow-Origin"] == "*"
    assert "X-Request-Id" in deployed.headers["Access-Control-Expose-Headers"]
    # Without Origin nothing changes; the admin is not open to other origins.
    assert "Access-Control-Allow-Origin" not in alice.deploy(name="ping", code=PONG).headers
    admin = requests.options(
        f"{alice.base_url}/admin/login/", headers={**origin, "Access-Control-Request-Method": "POST"}, timeout=30
    )
    assert "Access-Control-Allow-Origin" not in admin.headers
    # Calls and /_mcp are for agents' own processes: a preflight, which carries no token, is a 401.
    for path in ("/alice/ping", "/_mcp"):
        refused = requests.options(
            f"{alice.base_url}{path}", headers={**origin, "Access-Control-Request-Method": "POST"}, timeout=30
        )
        assert refused.status_code == 401 and "Access-Control-Allow-Origin" not in refused.headers, path


@pytest.fixture
def other_origin():
    """A page on another loopback port: another origin than Sigil's."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>an agent's page</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_a_page_of_another_origin_deploys_and_lists_with_a_token_in_a_real_browser(alice, page, other_origin):
    page.goto(other_origin)
    script = """async ([base, token, code]) => {
        const headers = {Authorization: `Bearer ${token}`, 'Content-Type': 'application/json'};
        const deployed = await fetch(`${base}/_api/deploy`,
            {method: 'POST', headers, body: JSON.stringify({name: 'ping', code})});
        const listed = await fetch(`${base}/_api/capabilities`, {headers});
        return [deployed.status, deployed.headers.get('x-request-id'), (await listed.json()).count];
    }"""

    status, request_id, count = page.evaluate(script, [alice.base_url, alice.deploy_token, PONG])

    assert (status, count) == (201, 1)
    assert request_id and len(request_id) == 16


def test_llms_txt_covers_what_an_agent_author_does(alice, settings):
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 5
    text = requests.get(f"{alice.base_url}/llms.txt", timeout=30).text
    for needed in (
        "DELETE ",  # removing a capability
        "Prefer: respond-async",
        '"callback": "/_api/calls/{call}", "eta_seconds": N',
        "every 5 s",  # the deploy cool-down, as configured
        '"name": null',  # ephemerals
        "/versions",
        "/rollback",
        "sigil.versions",
        "sigil.rollback",
        '"input_schema": {"type": "object"',  # the deploy example carries a contract
    ):
        assert needed in text, needed


def test_llms_txt_names_every_operation_an_agent_has(alice):
    """Every path of the OpenAPI description an agent's token opens is in the guide (the
    owner's /_api/cost and /metrics, and the guide itself, aside)."""
    schema = requests.get(f"{alice.base_url}/_api/schema?format=json", timeout=30).json()
    text = requests.get(f"{alice.base_url}/llms.txt", timeout=30).text
    owners = {"/_api/cost", "/metrics", "/llms.txt"}
    for path in set(schema["paths"]) - owners:
        # A path's fixed tail after its last parameter, as the guide writes it ("…/split/promote").
        tail = path.rsplit("}", 1)[-1] or path.split("{", 1)[0]
        assert tail in text, path


def test_the_agents_api_says_when_a_capability_is_inactive(alice, settings):
    assert alice.deploy(name="old", code=PONG, type="normal").status_code == 201
    assert alice.deploy(name="kept", code=PONG).status_code == 201
    Capability.objects.filter(full_name="alice--old").update(created_at=timezone.now() - timezone.timedelta(days=60))
    settings.SIGIL_INACTIVE_AFTER_DAYS = 30
    assert capability_mark_inactive() == 1

    listed = alice.session.get(
        f"{alice.base_url}/_api/capabilities", headers=alice.headers(alice.invoke_token), timeout=30
    ).json()["results"]
    shown = alice.session.get(
        f"{alice.base_url}/_api/capabilities/alice--old", headers=alice.headers(alice.invoke_token), timeout=30
    ).json()

    inactive = {row["capability"]: row["inactive_at"] for row in listed}
    assert inactive["alice--kept"] is None and inactive["alice--old"] is not None
    assert shown["inactive_at"] == inactive["alice--old"]
