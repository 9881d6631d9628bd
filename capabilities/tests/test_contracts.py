"""Capability contracts and the catalogue, over the REST API: what deploy accepts and refuses,
what makes a new version, what list, inspect and search show, and to whom."""

import pytest

from agents.models import AuditEvent
from capabilities.models import Capability, CapabilityVersion
from testsupport.capability_code import PONG, PONG2

ADD_INPUT = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ADD_OUTPUT = {"type": "object", "properties": {"sum": {"type": "number"}}, "required": ["sum"]}
ADD_CONTRACT = {
    "description": "Adds two numbers and answers their sum.",
    "input_schema": ADD_INPUT,
    "output_schema": ADD_OUTPUT,
    "examples": [{"input": {"a": 1, "b": 2}, "output": {"sum": 3}}],
}


def get(client, path):
    return client.session.get(f"{client.base_url}{path}", headers=client.headers(client.invoke_token), timeout=30)


def test_a_deployed_contract_is_shown_by_inspect_and_list(alice):
    response = alice.deploy(name="add", code=PONG, **ADD_CONTRACT)
    assert response.status_code == 201, response.text

    seen = get(alice, "/_api/capabilities/alice--add").json()
    assert {field: seen[field] for field in ADD_CONTRACT} == ADD_CONTRACT
    listed = get(alice, "/_api/capabilities").json()["results"]
    assert {field: listed[0][field] for field in ADD_CONTRACT} == ADD_CONTRACT
    assert AuditEvent.objects.get(action="capability.created").detail["contract"] == list(ADD_CONTRACT)


def test_a_capability_without_a_contract_shows_an_empty_one(alice):
    alice.deploy(name="ping", code=PONG)
    seen = get(alice, "/_api/capabilities/alice--ping").json()
    assert (seen["description"], seen["input_schema"], seen["output_schema"], seen["examples"]) == ("", None, None, [])
    assert alice.call("/alice/ping").text == "pong"


@pytest.mark.parametrize(
    ("contract", "message_part"),
    [
        ({"description": 42}, "description"),
        ({"description": "x" * 4097}, "4096"),
        ({"input_schema": "object"}, "input_schema"),
        ({"input_schema": {"type": "nonsense"}}, "input_schema is not a valid JSON Schema"),
        ({"input_schema": {"type": "array"}}, '"type": "object"'),
        ({"output_schema": {"type": "object", "minProperties": -1}}, "output_schema is not a valid JSON Schema"),
        ({"output_schema": {"$ref": "https://example.com/schema.json"}}, "points outside the schema"),
        ({"output_schema": {"$ref": "#/$defs/missing"}}, "does not resolve"),
        ({"output_schema": {"$ref": "#"}}, "without end"),
        ({"input_schema": {"type": "object", "title": "a\u0000b"}}, "NUL character"),
        ({"input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"}}, "2020-12"),
        ({"examples": {"input": {}}}, "examples"),
        ({"examples": [{"input": {}}] * 11}, "limit is 10"),
        ({"examples": [{"in": {}}]}, "examples[0]"),
        ({"input_schema": ADD_INPUT, "examples": [{"input": {"a": 1}}]}, "examples[0].input does not match"),
        ({"output_schema": ADD_OUTPUT, "examples": [{"output": {"sum": "3"}}]}, "at sum: '3' is not of type"),
    ],
)
def test_a_broken_contract_is_a_400_naming_the_problem(alice, contract, message_part):
    response = alice.deploy(name="add", code=PONG, **contract)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert message_part in error["message"]
    assert Capability.objects.count() == 0


def test_a_new_contract_is_a_new_version_and_the_same_one_again_is_not(alice):
    alice.deploy(name="add", code=PONG, **ADD_CONTRACT)
    again = alice.deploy(name="add", code=PONG, **ADD_CONTRACT)
    assert again.status_code == 200 and again.json()["version"] == 1

    described = alice.deploy(name="add", code=PONG, description="Adds two numbers.")
    assert described.json()["version"] == 2
    version = CapabilityVersion.objects.get(number=2)
    # The fields it omitted keep their value; only the description changed.
    assert (version.description, version.input_schema, version.examples) == (
        "Adds two numbers.",
        ADD_INPUT,
        ADD_CONTRACT["examples"],
    )
    assert alice.deploy(name="add", code=PONG).json()["version"] == 2  # omitting all of it keeps all of it

    cleared = alice.deploy(name="add", code=PONG, input_schema=None, examples=None)
    assert cleared.json()["version"] == 3
    seen = get(alice, "/_api/capabilities/alice--add").json()
    assert (seen["input_schema"], seen["examples"], seen["output_schema"]) == (None, [], ADD_OUTPUT)

    # New code keeps the contract too.
    assert alice.deploy(name="add", code=PONG2).json()["version"] == 4
    assert get(alice, "/_api/capabilities/alice--add").json()["description"] == "Adds two numbers."


def test_search_finds_names_and_descriptions_the_caller_may_see(alice, bob):
    alice.deploy(name="add", code=PONG, description="Adds two numbers.")
    alice.deploy(name="weather", code=PONG, description="Tells the weather of a city.", public=True)
    bob.deploy(name="forecast", code=PONG, description="Weather forecast for a week.", public=True)
    bob.deploy(name="secret-weather", code=PONG, description="Private weather notes.")

    def found(client, q):
        return [c["capability"] for c in get(client, f"/_api/capabilities?q={q}").json()["results"]]

    assert found(alice, "weather") == ["alice--weather", "bob--forecast"]
    assert found(alice, "WEATHER+week") == ["bob--forecast"]
    assert found(alice, "add") == ["alice--add"]
    assert found(bob, "add") == []  # alice's private capability
    assert found(bob, "weather") == ["alice--weather", "bob--forecast", "bob--secret-weather"]
    assert found(alice, "alice--we") == ["alice--weather"]
    listed = get(alice, "/_api/capabilities?q=forecast").json()["results"][0]
    assert listed["description"] == "Weather forecast for a week."

    blank = get(alice, "/_api/capabilities?q=+")
    assert blank.status_code == 400 and blank.json()["error"]["code"] == "invalid_request"


def test_another_agents_private_contract_is_not_found(alice, bob):
    bob.deploy(name="hidden", code=PONG, **ADD_CONTRACT)
    response = get(alice, "/_api/capabilities/bob--hidden")
    assert response.status_code == 404


def test_the_openapi_schema_documents_the_contract_and_search(sigil):
    import requests

    schema = requests.get(f"{sigil.url}/_api/schema?format=json", timeout=30).json()
    ref = schema["paths"]["/_api/deploy"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    deploy = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    assert {"description", "input_schema", "output_schema", "examples"} <= set(deploy)
    listed = schema["components"]["schemas"]["Capability"]["properties"]
    assert {"description", "input_schema", "output_schema", "examples"} <= set(listed)
    parameters = schema["paths"]["/_api/capabilities"]["get"]["parameters"]
    assert "q" in [parameter["name"] for parameter in parameters]
