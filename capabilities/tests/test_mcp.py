"""/_mcp driven by the official MCP Python SDK's own client over HTTP, against Sigil served on
loopback: the stateless revision (2026-07-28) and a session-based one (2025-11-25)."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import anyio
import pytest
import requests
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from agents.models import AuditEvent
from capabilities.tests.test_contracts import ADD_CONTRACT, ADD_INPUT, ADD_OUTPUT
from sigil import redis_keys
from testsupport.capability_code import PONG
from testsupport.cast import wait_for

# Answers the sum of a and b, as JSON.
ADD = """export default { async fetch(request) {
  const { a, b } = await request.json();
  return Response.json({ sum: a + b });
} }"""
# Fails as a capability may: its own 500, or an exception.
FAILING = "export default { async fetch() { return new Response('the database is down', { status: 500 }) } }"
THROWING = "export default { async fetch() { throw new Error('no luck today') } }"
# Answers JSON that breaks the output schema it declares.
WRONG_SUM = "export default { async fetch() { return Response.json({ sum: 'three' }) } }"

MODES = [pytest.param("2026-07-28", id="stateless-2026-07-28"), pytest.param("legacy", id="session-2025-11-25")]


@asynccontextmanager
async def connected(base_url: str, token: str, mode: str):
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with http:
        transport = streamable_http_client(f"{base_url}/_mcp", http_client=http)
        async with Client(transport, mode=mode, cache=None) as client:
            yield client


def run(sigil, token: str, mode: str, steps):
    """Run `steps(client)` on a client connected to `sigil`; return what it returns."""
    return run_at(sigil.url, token, mode, steps)


def run_at(base_url: str, token: str, mode: str, steps):
    async def main():
        async with connected(base_url, token, mode) as client:
            return await steps(client)

    return anyio.run(main)


async def all_tools(client) -> list:
    tools, cursor = [], None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if cursor is None:
            return tools


@pytest.mark.parametrize("mode", [*MODES, pytest.param("auto", id="auto-discovers-2026-07-28")])
def test_the_protocol_is_negotiated_and_tools_are_what_the_agent_may_call(sigil, alice, bob, mode):
    alice.deploy(name="add", code=ADD, **ADD_CONTRACT)
    alice.deploy(name="ping", code=PONG)
    bob.deploy(name="public-ping", code=PONG, public=True, description="Pong, for anyone.")
    bob.deploy(name="private-ping", code=PONG)

    async def steps(client):
        return client.protocol_version, client.server_info, await all_tools(client)

    version, server_info, tools = run(sigil, alice.invoke_token, mode, steps)
    assert version == ("2026-07-28" if mode != "legacy" else "2025-11-25")
    if mode == "legacy":
        assert server_info.name == "sigil"
    by_name = {tool.name: tool for tool in tools}
    assert sorted(by_name) == ["alice--add", "alice--ping", "bob--public-ping"]  # no sigil.* with an invoke token
    add = by_name["alice--add"]
    assert add.description == ADD_CONTRACT["description"]
    assert add.input_schema == ADD_INPUT and add.output_schema == ADD_OUTPUT
    assert by_name["alice--ping"].input_schema == {"type": "object"} and by_name["alice--ping"].output_schema is None
    assert by_name["bob--public-ping"].description == "Pong, for anyone."


@pytest.mark.parametrize("mode", MODES)
def test_a_tool_call_reaches_the_capability_through_the_gateway(sigil, alice, redis_client, mode):
    alice.deploy(name="add", code=ADD, **ADD_CONTRACT)
    alice.deploy(name="ping", code=PONG)

    async def steps(client):
        await client.list_tools()
        return await client.call_tool("alice--add", {"a": 2, "b": 3}), await client.call_tool("alice--ping", {})

    added, pinged = run(sigil, alice.invoke_token, mode, steps)
    assert not added.is_error
    assert added.structured_content == {"sum": 5}
    assert json.loads(added.content[0].text) == {"sum": 5}
    assert not pinged.is_error and pinged.content[0].text == "pong" and pinged.structured_content is None
    # Counted as calls of the capabilities, as a direct call is (the gateway recorded them,
    # a success up to a batch's wait after its answer).
    wait_for(
        lambda: [redis_client.hget(redis_keys.stats(f"alice--{name}"), "calls") for name in ("add", "ping")]
        == [b"1", b"1"],
        message="both calls counted once",
    )


@pytest.mark.parametrize("mode", MODES)
def test_arguments_that_break_the_input_schema_are_refused_before_the_call(sigil, alice, redis_client, mode):
    alice.deploy(name="add", code=ADD, **ADD_CONTRACT)

    async def steps(client):
        await client.list_tools()
        return await client.call_tool("alice--add", {"a": 2})

    result = run(sigil, alice.invoke_token, mode, steps)
    assert result.is_error
    assert "do not match alice--add's input schema" in result.content[0].text
    assert "'b' is a required property" in result.content[0].text
    assert redis_client.hget(redis_keys.stats("alice--add"), "calls") is None  # the capability never ran
    # Over HTTP the body reaches the code as sent (docs/contract.md, where the schemas are enforced).
    direct = alice.call("/alice/add", method="POST", json={"a": 2})
    assert (direct.status_code, direct.json()) == (200, {"sum": None})  # 2 + undefined is NaN, written as null


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_capability_is_a_tool_error_with_sigils_message(sigil, alice, mode):
    alice.deploy(name="down", code=FAILING)
    alice.deploy(name="throws", code=THROWING)
    alice.deploy(name="wrong", code=WRONG_SUM, output_schema=ADD_OUTPUT)

    async def steps(client):
        await client.list_tools()
        return [await client.call_tool(name, {}) for name in ("alice--down", "alice--throws", "alice--wrong")]

    down, throws, wrong = run(sigil, alice.invoke_token, mode, steps)
    assert down.is_error and down.content[0].text == "alice--down answered 500: the database is down"
    assert throws.is_error and throws.content[0].text == "capability_error: alice--throws threw: Error: no luck today"
    assert wrong.is_error and "does not match its output schema" in wrong.content[0].text


@pytest.mark.parametrize("mode", MODES)
def test_unknown_and_hidden_tools_are_invalid_params(sigil, alice, bob, mode):
    bob.deploy(name="private-ping", code=PONG)

    async def steps(client):
        errors = []
        for name in ("bob--private-ping", "nobody--nothing", "no tool at all", "sigil.deploy"):
            try:
                await client.call_tool(name, {})
            except MCPError as error:
                errors.append((error.code, error.error.message))
        return errors

    errors = run(sigil, alice.invoke_token, mode, steps)
    assert [code for code, _ in errors] == [-32602] * 4
    assert errors[0][1] == errors[1][1].replace("nobody--nothing", "bob--private-ping")  # nothing revealed
    assert "needs a deploy token" in errors[3][1]


@pytest.mark.parametrize("mode", MODES)
def test_an_agent_deploys_a_tool_over_mcp_and_calls_it_at_once(sigil, alice, mode):
    async def steps(client):
        before = {tool.name for tool in await all_tools(client)}
        deployed = await client.call_tool("sigil.deploy", {"name": "add", "code": ADD, **ADD_CONTRACT, "public": True})
        after = {tool.name: tool for tool in await all_tools(client)}
        called = await client.call_tool("alice--add", {"a": 40, "b": 2})
        listed = await client.call_tool("sigil.list", {"q": "sum"})
        inspected = await client.call_tool("sigil.inspect", {"capability": "alice--add"})
        again = await client.call_tool("sigil.deploy", {"name": "add", "code": PONG, "ttl": 5})
        removed = await client.call_tool("sigil.remove", {"capability": "alice--add"})
        gone = {tool.name for tool in await all_tools(client)}
        return before, deployed, after, called, listed, inspected, again, removed, gone

    before, deployed, after, called, listed, inspected, again, removed, gone = run(
        sigil, alice.deploy_token, mode, steps
    )
    assert before == {
        "sigil.deploy",
        "sigil.list",
        "sigil.inspect",
        "sigil.logs",
        "sigil.remove",
        "sigil.versions",
        "sigil.rollback",
    }
    assert not deployed.is_error, deployed.content[0].text
    assert deployed.structured_content["tool"] == "alice--add" and deployed.structured_content["version"] == 1
    assert after["alice--add"].input_schema == ADD_INPUT
    assert called.structured_content == {"sum": 42}
    assert [c["capability"] for c in listed.structured_content["capabilities"]] == ["alice--add"]
    assert inspected.structured_content["code"] == ADD and inspected.structured_content["public"] is True
    assert again.is_error and again.content[0].text.startswith("invalid_request: ttl applies to ephemeral")
    assert not removed.is_error
    assert "alice--add" not in gone
    # The same audit events as over the REST API.
    actions = list(AuditEvent.objects.filter(subject="alice--add").order_by("pk").values_list("action", "actor"))
    assert actions == [("capability.created", "agent:alice"), ("capability.removed", "agent:alice")]


def test_the_deploy_cooldown_holds_over_mcp(sigil, alice, settings):
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 60

    async def steps(client):
        first = await client.call_tool("sigil.deploy", {"name": "one", "code": PONG})
        second = await client.call_tool("sigil.deploy", {"name": "two", "code": PONG})
        return first, second

    first, second = run(sigil, alice.deploy_token, "2026-07-28", steps)
    assert not first.is_error
    assert second.is_error and second.content[0].text.startswith("cooldown: alice deployed less than 60 s ago")


def test_tools_list_is_paginated_with_next_cursor(sigil, alice):
    from agents.models import Agent
    from capabilities.models import Capability

    owner = Agent.objects.get(name="alice")
    # Rows enough for three pages; listing reads the registry, so they need not be placed.
    Capability.objects.bulk_create(
        Capability(agent=owner, name=f"c{i:03}", full_name=f"alice--c{i:03}", type="persistent", state="paged_out")
        for i in range(230)
    )

    async def steps(client):
        pages, cursor = [], None
        while True:
            page = await client.list_tools(cursor=cursor)
            pages.append([tool.name for tool in page.tools])
            cursor = page.next_cursor
            if cursor is None:
                return pages

    pages = run(sigil, alice.invoke_token, "2026-07-28", steps)
    assert [len(page) for page in pages] == [100, 100, 30]
    assert [name for page in pages for name in page] == [f"alice--c{i:03}" for i in range(230)]


# What the official client does not send, over raw HTTP.


def post(sigil, token, message, **headers):
    return requests.post(
        f"{sigil.url}/_mcp",
        data=message if isinstance(message, bytes) else json.dumps(message),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json", **headers},
        timeout=30,
    )


def test_initialize_negotiates_a_session_revision(sigil, alice):
    def initialize(version):
        return post(
            sigil,
            alice.invoke_token,
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
            },
        )

    older = initialize("2025-06-18")
    assert older.status_code == 200 and older.json()["result"]["protocolVersion"] == "2025-06-18"
    session = older.headers["Mcp-Session-Id"]
    assert initialize("2024-01-01").json()["result"]["protocolVersion"] == "2025-11-25"
    assert initialize("2026-07-28").json()["result"]["protocolVersion"] == "2025-11-25"

    headers = {"Mcp-Session-Id": session, "MCP-Protocol-Version": "2025-06-18"}
    assert (
        post(
            sigil, alice.invoke_token, {"jsonrpc": "2.0", "method": "notifications/initialized"}, **headers
        ).status_code
        == 202
    )
    pong = post(sigil, alice.invoke_token, {"jsonrpc": "2.0", "id": 2, "method": "ping"}, **headers)
    assert pong.json() == {"jsonrpc": "2.0", "id": 2, "result": {}}
    # A session is its token's: another token does not find it.
    stranger = post(sigil, alice.deploy_token, {"jsonrpc": "2.0", "id": 3, "method": "ping"}, **headers)
    assert stranger.status_code == 404
    missing = post(sigil, alice.invoke_token, {"jsonrpc": "2.0", "id": 4, "method": "ping"})
    assert missing.status_code == 400
    ended = requests.delete(
        f"{sigil.url}/_mcp", headers={"Authorization": f"Bearer {alice.invoke_token}", **headers}, timeout=30
    )
    assert ended.status_code == 204
    assert post(sigil, alice.invoke_token, {"jsonrpc": "2.0", "id": 5, "method": "ping"}, **headers).status_code == 404


MODERN = {"MCP-Protocol-Version": "2026-07-28"}
META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {},
}


@pytest.mark.parametrize(
    ("message", "headers", "status", "code"),
    [
        (b"{not json", MODERN, 400, -32700),
        ([{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}], MODERN, 400, -32600),
        ({"jsonrpc": "1.0", "id": 1, "method": "tools/list"}, MODERN, 400, -32600),
        ({"jsonrpc": "2.0", "id": None, "method": "tools/list"}, MODERN, 400, -32600),
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}, MODERN, 400, -32602),
        (
            {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": META}},
            {**MODERN, "Mcp-Method": "tools/call"},
            400,
            -32020,
        ),
        (
            {"jsonrpc": "2.0", "id": 1, "method": "no/such", "params": {"_meta": META}},
            {**MODERN, "Mcp-Method": "no/such"},
            404,
            -32601,
        ),
        (
            {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"_meta": META}},
            {**MODERN, "Mcp-Method": "ping"},
            404,
            -32601,
        ),
        (
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/list",
                "params": {"_meta": {**META, "io.modelcontextprotocol/protocolVersion": "2099-01-01"}},
            },
            {"MCP-Protocol-Version": "2099-01-01", "Mcp-Method": "tools/list"},
            400,
            -32022,
        ),
        (
            {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"cursor": "%%%", "_meta": META}},
            {**MODERN, "Mcp-Method": "tools/list"},
            400,
            -32602,
        ),
    ],
)
def test_json_rpc_errors_are_as_the_spec_says(sigil, alice, message, headers, status, code):
    response = post(sigil, alice.invoke_token, message, **headers)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    if code == -32022:
        assert response.json()["error"]["data"] == {"supported": ["2026-07-28"], "requested": "2099-01-01"}


def test_http_level_refusals(sigil, alice, settings):
    no_token = requests.post(f"{sigil.url}/_mcp", json={}, timeout=30)
    assert no_token.status_code == 401 and no_token.headers["WWW-Authenticate"] == 'Bearer realm="sigil"'
    assert no_token.json()["error"]["data"]["code"] == "unauthenticated"
    get = requests.get(f"{sigil.url}/_mcp", headers={"Authorization": f"Bearer {alice.invoke_token}"}, timeout=30)
    assert get.status_code == 405
    form = post(sigil, alice.invoke_token, b"a=b", **{"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415
    settings.SIGIL_DEPLOY_MAX_BODY_BYTES = 1000
    big = post(sigil, alice.invoke_token, {"jsonrpc": "2.0", "id": 1, "method": "x", "params": {"p": "x" * 1000}})
    assert big.status_code == 413 and big.json()["error"]["data"]["code"] == "too_large"


def test_a_new_contract_holds_from_the_next_call(sigil, alice):
    alice.deploy(name="add", code=ADD, **ADD_CONTRACT)

    async def call(client):
        return await client.call_tool("alice--add", {"a": 1, "b": 2, "c": 3})

    assert run(sigil, alice.invoke_token, "2026-07-28", call).is_error  # additionalProperties: false
    looser = {**ADD_INPUT, "additionalProperties": True}
    assert alice.deploy(name="add", code=ADD, input_schema=looser).json()["version"] == 2
    assert run(sigil, alice.invoke_token, "2026-07-28", call).structured_content == {"sum": 3}


def test_llms_txt_guides_agents_to_the_api_and_mcp(sigil):
    response = requests.get(f"{sigil.url}/llms.txt", timeout=30)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
    text = response.text
    assert text.startswith("# Sigil")
    for where in ("/_api/deploy", "/_api/capabilities?q=", "/_mcp", "/_api/schema"):
        assert f"{sigil.url}{where}" in text


def test_a_tool_call_pages_a_cold_capability_in(settings, alice, celery_worker):
    from capabilities.models import Capability
    from testsupport.cast import deploy_answering

    settings.SIGIL_LOCAL_SLOTS = 3
    settings.SIGIL_POOL_SAFETY_MARGIN = 2
    for name in ("a", "b", "c"):
        deploy_answering(alice, name, name, type="normal")
    assert deploy_answering(alice, "d", "d", type="normal")["evicted"] == "alice--a"
    wait_for(lambda: Capability.objects.get(full_name="alice--a").state == "paged_out", message="a paged out")

    async def call(client):
        return await client.call_tool("alice--a", {})

    result = run_at(alice.base_url, alice.invoke_token, "2026-07-28", call)
    assert not result.is_error and result.content[0].text == "a"
    assert Capability.objects.get(full_name="alice--a").state == "live"


def test_the_breaker_holds_for_tool_calls(sigil, alice, settings):
    settings.SIGIL_BREAKER_THRESHOLD = 2
    alice.deploy(name="down", code=FAILING)

    async def steps(client):
        return [await client.call_tool("alice--down", {}) for _ in range(3)]

    first, second, third = run(sigil, alice.invoke_token, "2026-07-28", steps)
    assert first.is_error and second.is_error
    assert third.is_error and third.content[0].text.startswith("degraded: ")
