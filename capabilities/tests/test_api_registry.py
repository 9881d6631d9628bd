"""List, inspect, remove, status, health and the schema, over HTTP."""

import pytest
import requests

from agents.models import AuditEvent
from capabilities.models import Capability
from capabilities.runtimes import get_runtime
from testsupport.capability_code import PONG


def get(client, path, token=None):
    return client.session.get(
        f"{client.base_url}{path}", headers=client.headers(token or client.invoke_token), timeout=30
    )


def test_list_shows_own_and_public_with_filters_and_pages(alice, bob):
    alice.deploy(name="a-private", code=PONG)
    alice.deploy(name="a-public", code=PONG, public=True, type="normal")
    bob.deploy(name="b-private", code=PONG)
    bob.deploy(name="b-public", code=PONG, public=True)

    listed = get(alice, "/_api/capabilities").json()
    assert [c["capability"] for c in listed["results"]] == ["alice--a-private", "alice--a-public", "bob--b-public"]
    assert listed["count"] == 3

    assert [c["capability"] for c in get(alice, "/_api/capabilities?type=normal").json()["results"]] == [
        "alice--a-public"
    ]
    assert [c["capability"] for c in get(alice, "/_api/capabilities?agent=bob").json()["results"]] == ["bob--b-public"]

    page = get(alice, "/_api/capabilities?limit=2").json()
    assert len(page["results"]) == 2 and page["next"] is not None
    second = requests.get(page["next"], headers=alice.headers(alice.invoke_token), timeout=30).json()
    assert [c["capability"] for c in second["results"]] == ["bob--b-public"]


def test_list_rejects_unknown_filter_values(alice):
    response = get(alice, "/_api/capabilities?type=forever")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"


def test_list_refuses_a_nul_in_a_text_filter_on_every_database(alice):
    for query in ("agent=bo%00b", "q=pi%00ng"):
        response = get(alice, f"/_api/capabilities?{query}")
        assert response.status_code == 400, query
        assert "NUL" in response.json()["error"]["message"]


@pytest.mark.parametrize("query", ["offset=null", "offset=-1", "limit=0", "limit=ten", "offset=%D9%A3"])
def test_list_refuses_a_page_that_is_not_a_whole_number_in_range(alice, query):
    response = get(alice, f"/_api/capabilities?{query}")
    assert response.status_code == 400, query
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and query.split("=")[0] in error["message"]


def test_list_pages_by_limit_and_offset_with_the_limit_capped(alice):
    for name in ("a", "b", "c"):
        alice.deploy(name=name, code=PONG)
    page = get(alice, "/_api/capabilities?limit=2&offset=1").json()
    assert [c["capability"] for c in page["results"]] == ["alice--b", "alice--c"]
    assert page["count"] == 3
    assert get(alice, "/_api/capabilities?limit=5000").status_code == 200  # read as 200


def test_inspect_shows_metadata_and_own_code(alice):
    from capabilities.models import Binding
    from testsupport.cast import grant

    grant(Binding.objects.create(kind="VAR", name="GREETING", value="hello"), "alice")
    alice.deploy(name="ping", code=PONG, bindings=["VAR:GREETING"])
    seen = get(alice, "/_api/capabilities/alice--ping").json()
    assert seen["capability"] == "alice--ping"
    assert seen["version"] == 1 and seen["type"] == "persistent" and seen["state"] == "live"
    assert seen["bindings"] == ["VAR:GREETING"]
    assert seen["code"] == PONG
    assert seen["url"].endswith("/alice/ping")


def test_inspect_of_a_malformed_name_is_a_400(alice):
    response = get(alice, "/_api/capabilities/not-a-full-name")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"


def test_remove_stops_serving_and_keeps_the_trail(alice, celery_worker):
    from testsupport.cast import wait_for

    alice.deploy(name="ping", code=PONG)
    assert alice.call("/alice/ping").status_code == 200
    removed = alice.session.delete(
        f"{alice.base_url}/_api/capabilities/alice--ping", headers=alice.headers(alice.deploy_token)
    )
    assert removed.status_code == 204
    assert alice.call("/alice/ping").status_code == 404
    assert get(alice, "/_api/capabilities/alice--ping").status_code == 404
    capability = Capability.objects.get(full_name="alice--ping")
    assert capability.state == "removed" and capability.versions.count() == 1
    assert AuditEvent.objects.filter(subject="alice--ping", action="capability.removed").exists()
    # The worker deletes the code from the runtime in the background.
    wait_for(lambda: "alice--ping" not in get_runtime().list_slots(), message="the slot to be released")


def test_remove_twice_is_not_found_the_second_time(alice):
    alice.deploy(name="ping", code=PONG)
    url = f"{alice.base_url}/_api/capabilities/alice--ping"
    assert alice.session.delete(url, headers=alice.headers(alice.deploy_token)).status_code == 204
    second = alice.session.delete(url, headers=alice.headers(alice.deploy_token))
    assert second.status_code == 404 and second.json()["error"]["code"] == "not_found"


def test_a_removed_name_can_be_deployed_again(alice):
    alice.deploy(name="ping", code=PONG)
    alice.session.delete(f"{alice.base_url}/_api/capabilities/alice--ping", headers=alice.headers(alice.deploy_token))
    again = alice.deploy(name="ping", code=PONG.replace("pong", "reborn"))
    assert again.status_code == 201 and again.json()["version"] == 1
    assert alice.call("/alice/ping").text == "reborn"


def test_status_reports_the_local_backend(alice):
    alice.deploy(name="ping", code=PONG)
    status = get(alice, "/_api/status").json()
    assert status == {
        "backend": "local",
        "total_slots": None,
        "used_slots": 1,
        "paging_out": 0,
        "agents": 1,
        "lru_enabled": False,
        "eviction_count": 0,
    }


def test_health_checks_every_dependency(sigil, alice):
    alice.deploy(name="ping", code=PONG)
    health = requests.get(f"{sigil.url}/_health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {
        "status": "ok",
        "backend": "local",
        "capabilities": 1,
        "agents": 1,
        "checks": {"database": "ok", "redis": "ok", "runtime": "ok", "previous_runtimes": "ok"},
    }


def test_health_fails_with_the_runtime_named_when_no_workerd_supervisor_runs(sigil, settings, tmp_path):
    from capabilities.runtimes import runtimes_forget

    settings.VAR_DIR = tmp_path  # where no runworkerd writes its status
    runtimes_forget()
    health = requests.get(f"{sigil.url}/_health", timeout=10)
    assert health.status_code == 503
    runtime_check = health.json()["checks"]["runtime"]
    assert runtime_check == "failing: the workerd supervisor is not running (`manage.py runworkerd`)"
    assert health.json()["checks"]["database"] == "ok"


def test_schema_describes_the_control_api(sigil):
    schema = requests.get(f"{sigil.url}/_api/schema?format=json", timeout=10)
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert {"/_api/deploy", "/_api/capabilities", "/_api/capabilities/{full}", "/_api/status"} <= set(paths)
    docs = requests.get(f"{sigil.url}/_api/schema/docs", timeout=10)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_the_schema_teaches(sigil):
    schema = requests.get(f"{sigil.url}/_api/schema?format=json", timeout=10).json()
    operations = [op for path in schema["paths"].values() for op in path.values()]
    # Every operation has a summary and a group named for what it is for.
    assert all(op.get("summary") for op in operations)
    assert {tag for op in operations for tag in op["tags"]} == {"Deploy", "Call", "Discover", "Operate"}
    assert [tag["name"] for tag in schema["tags"]] == ["Deploy", "Call", "Discover", "Operate"]
    # The routes served outside Django's views are there too.
    assert {"get", "post"} <= set(schema["paths"]["/{agent}/{capability}"])
    call = schema["paths"]["/{agent}/{capability}"]["post"]
    assert {"Prefer", "X-Callback-Url"} <= {parameter["name"] for parameter in call["parameters"]}
    assert "private address" in call["responses"]["400"]["description"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    # Schemas named for what they hold; the error envelope is one of them, used for every error.
    components = schema["components"]["schemas"]
    assert {"DeployRequest", "Deployed", "Error", "Capability", "CapabilityDetail"} <= set(components)
    assert not {"InputRequest", "Output", "ErrorDetail", "NullEnum"} & set(components)
    for path in schema["paths"].values():
        for op in path.values():
            for status, answer in op["responses"].items():
                failing_health = (op["operationId"], status) == ("health", "503")  # the health report itself
                if (
                    status.startswith(("4", "5"))
                    and "application/json" in answer.get("content", {})
                    and not failing_health
                ):
                    documented = answer["content"]["application/json"]["schema"]
                    if op["operationId"] == "mcp":  # JSON-RPC's error shape, Sigil's code in its data
                        assert documented["properties"]["error"]["properties"]["code"]["type"] == "integer"
                    else:
                        assert documented == {"$ref": "#/components/schemas/Error"}
    # Deploy shows what to send and what comes back, and errors have examples.
    deploy = schema["paths"]["/_api/deploy"]["post"]
    examples = deploy["requestBody"]["content"]["application/json"]["examples"]
    assert any(example["value"].get("name") == "ping" for example in examples.values())
    assert "examples" in deploy["responses"]["201"]["content"]["application/json"]
    conflict = deploy["responses"]["409"]["content"]["application/json"]["examples"]
    assert next(iter(conflict.values()))["value"]["error"]["code"] == "conflict"


def test_unknown_paths_outside_the_gateway_answer_in_the_envelope(sigil):
    response = requests.get(f"{sigil.url}/_api/nothing-here", timeout=10)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
