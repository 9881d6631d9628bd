"""Deploy's rules and bad input: the status, the envelope's code, and no row left behind."""

import json

import pytest
import requests

from agents.models import AuditEvent
from capabilities.models import Capability, CapabilityVersion
from testsupport.capability_code import PONG


def rows():
    return Capability.objects.count(), CapabilityVersion.objects.count()


def assert_rejected(send, status, code, *, message_part=None):
    """Sends a deploy (`send()`) that must be refused with `status` and `code`, and leave no
    capability or version behind. Returns the response."""
    before = rows()
    response = send()
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    if message_part:
        assert message_part in error["message"]
    assert rows() == before
    return response


def raw_deploy(alice, data: bytes, content_type="application/json"):
    return requests.post(
        f"{alice.base_url}/_api/deploy",
        data=data,
        headers={**alice.headers(alice.deploy_token), "Content-Type": content_type},
        timeout=30,
    )


@pytest.mark.parametrize(
    ("body", "message_part"),
    [
        ({"name": "Bad_Name", "code": PONG}, "must match"),
        ({"name": "a--b", "code": PONG}, "must match"),
        ({"name": "x" * 42, "code": PONG}, "must match"),
        ({"name": "-lead", "code": PONG}, "must match"),
        ({"name": "t-abc123", "code": PONG}, "reserved for ephemeral"),
        ({"name": "ping", "code": ""}, "code"),
        ({"name": "ping", "code": "   "}, "non-empty"),
        ({"name": "ping"}, "code"),
        ({"name": 42, "code": PONG}, "name"),
        ({"name": "ping", "code": 7}, "code"),
        ({"name": "ping", "code": PONG, "public": "yes"}, "public"),
        ({"name": "ping", "code": PONG, "type": "forever"}, "type"),
        ({"name": "ping", "code": PONG, "ttl": 60}, "ephemeral"),
        ({"code": PONG, "ttl": 0}, "ttl"),
        ({"code": PONG, "ttl": 86401}, "ttl"),
        ({"code": PONG, "ttl": "3600"}, "ttl"),
        ({"code": PONG, "ttl": 3600.5}, "ttl"),
        ({"name": "ping", "code": PONG, "bindings": "KV:CACHE"}, "bindings"),
        ({"name": "ping", "code": PONG, "bindings": ["cache"]}, "KIND:NAME"),
        ({"name": None, "code": PONG, "type": "persistent"}, "name is required"),
        ({"name": "ping", "code": PONG, "colour": "red"}, "unknown field"),
    ],
)
def test_bad_deploy_input_is_a_400_and_creates_nothing(alice, body, message_part):
    assert_rejected(lambda: alice.deploy(**body), 400, "invalid_request", message_part=message_part)
    assert Capability.objects.count() == 0
    assert CapabilityVersion.objects.count() == 0


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b'"just a string"', b"", b"\xff\xfe"])
def test_malformed_json_is_a_400(alice, data):
    assert_rejected(lambda: raw_deploy(alice, data), 400, "invalid_request")
    assert Capability.objects.count() == 0


def test_wrong_content_type_is_a_400_in_the_envelope(alice):
    response = raw_deploy(alice, b"name=ping", content_type="application/x-www-form-urlencoded")
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "invalid_request"


def test_code_over_the_script_limit_is_a_413(alice, settings):
    settings.SIGIL_SCRIPT_MAX_BYTES = 1000
    code = "export default { async fetch() { return new Response('" + "x" * 1000 + "') } }"
    assert_rejected(lambda: alice.deploy(name="big", code=code), 413, "too_large")
    assert Capability.objects.count() == 0


def test_body_over_djangos_own_upload_limit_is_a_413(alice):
    # 20 MiB: above both the 10 MB script limit and the deploy body limit.
    body = json.dumps({"name": "huge", "code": "x" * (20 * 1024 * 1024)}).encode()
    assert_rejected(lambda: raw_deploy(alice, body), 413, "too_large")
    assert Capability.objects.count() == 0


def test_script_just_under_ten_megabytes_deploys(alice):
    padding = "/*" + "x" * (10 * 1000 * 1000 - 200) + "*/"
    code = padding + "export default { async fetch() { return new Response('big ok') } }"
    response = alice.deploy(name="big", code=code)
    assert response.status_code == 201, response.text
    assert alice.call("/alice/big").text == "big ok"


def test_agent_field_must_be_the_tokens_agent(alice):
    assert alice.deploy(agent="alice", name="mine", code=PONG).status_code == 201
    assert_rejected(lambda: alice.deploy(agent="bob", name="theirs", code=PONG), 403, "forbidden")


def test_name_taken_by_another_type_is_a_conflict(alice):
    assert alice.deploy(name="ping", code=PONG, type="normal").status_code == 201
    error = assert_rejected(
        lambda: alice.deploy(name="ping", code=PONG + " ", type="persistent"), 409, "conflict"
    ).json()["error"]
    assert "normal" in error["message"]
    assert Capability.objects.get(full_name="alice--ping").type == "normal"


def test_a_redeploy_without_type_or_public_keeps_them(alice, bob):
    assert alice.deploy(name="ping", code=PONG, type="normal", public=True).status_code == 201
    redeployed = alice.deploy(name="ping", code=PONG + " ")
    assert redeployed.status_code == 200, redeployed.text
    assert redeployed.json()["version"] == 2
    inspected = bob.session.get(f"{bob.base_url}/_api/capabilities/alice--ping", headers=bob.headers(bob.invoke_token))
    assert inspected.status_code == 200
    assert (inspected.json()["type"], inspected.json()["public"]) == ("normal", True)
    # Sent, they still change what they name.
    assert alice.deploy(name="ping", code=PONG + "  ", public=False).status_code == 200
    assert bob.call("/alice/ping").status_code == 404
    assert Capability.objects.get(full_name="alice--ping").type == "normal"


def test_an_unchanged_redeploy_without_public_keeps_it(alice, bob):
    assert alice.deploy(name="ping", code=PONG, public=True).status_code == 201
    assert alice.deploy(name="ping", code=PONG).status_code == 200
    assert bob.call("/alice/ping").status_code == 200


def test_a_new_capability_without_type_or_public_is_persistent_and_private(alice, bob):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    inspected = alice.session.get(
        f"{alice.base_url}/_api/capabilities/alice--ping", headers=alice.headers(alice.invoke_token)
    )
    assert (inspected.json()["type"], inspected.json()["public"]) == ("persistent", False)
    assert bob.call("/alice/ping").status_code == 404


def test_an_ephemeral_redeployed_by_name_without_type_stays_ephemeral(alice):
    full = alice.deploy(code=PONG, public=True).json()["capability"]
    name = full.split("--", 1)[1]
    redeployed = alice.deploy(name=name, code=PONG + " ")
    assert redeployed.status_code == 200, redeployed.text
    capability = Capability.objects.get(full_name=full)
    assert (capability.type, capability.is_public) == ("ephemeral", True)


def test_deploy_cooldown_answers_429_with_retry_after(alice, settings):
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 5
    assert alice.deploy(name="one", code=PONG).status_code == 201
    second = assert_rejected(lambda: alice.deploy(name="two", code=PONG), 429, "cooldown")
    assert 1 <= int(second.headers["Retry-After"]) <= 5
    assert not Capability.objects.filter(full_name="alice--two").exists()
    # An unchanged redeploy is a no-op and is not held back by the cool-down.
    assert alice.deploy(name="one", code=PONG).status_code == 200


def test_cooldown_is_per_agent(alice, bob, settings):
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 5
    assert alice.deploy(name="one", code=PONG).status_code == 201
    assert bob.deploy(name="one", code=PONG).status_code == 201


def test_ephemeral_gets_a_generated_name_and_expiry(alice):
    response = alice.deploy(code=PONG, ttl=120)
    assert response.status_code == 201
    body = response.json()
    assert body["capability"].startswith("alice--t-") and len(body["capability"]) == len("alice--t-") + 6
    capability = Capability.objects.get(full_name=body["capability"])
    assert capability.type == "ephemeral"
    assert abs((capability.expires_at - capability.created_at).total_seconds() - 120) < 1
    assert body["expires_at"] is not None


def test_at_most_twenty_ephemerals_per_agent(alice, settings):
    settings.SIGIL_EPHEMERAL_MAX_PER_AGENT = 3
    for i in range(3):
        assert alice.deploy(code=PONG.replace("pong", f"e{i}")).status_code == 201
    assert_rejected(lambda: alice.deploy(code=PONG.replace("pong", "e3")), 429, "rate_limited")
    assert Capability.objects.filter(type="ephemeral").count() == 3


def test_deploy_is_audited(alice):
    alice.deploy(name="ping", code=PONG)
    alice.deploy(name="ping", code=PONG + "\n")
    actions = list(AuditEvent.objects.filter(subject="alice--ping").values_list("action", "actor"))
    assert actions == [("capability.deployed", "agent:alice"), ("capability.created", "agent:alice")]


@pytest.mark.parametrize(
    ("code", "words"),
    [
        ("export default { async fetch() { return new Response('pong') ", "SyntaxError"),
        ("const config = JSON.parse('{'); export default { fetch() { return new Response('x') } }", "SyntaxError"),
        ("throw new Error('missing setting'); export default {}", "Error: missing setting"),
        ("export default {}", "the code's default export has no fetch handler"),
        ("export default class { scheduled() {} }", "the code's default export has no fetch handler"),
        ("export default async (request) => new Response('x')", "the code's default export has no fetch handler"),
        ("0", "the code has no default export"),
        ("export const fetch = () => new Response('x')", "the code has no default export"),
    ],
)
def test_code_that_does_not_start_is_a_400_with_the_reason_and_creates_nothing(alice, code, words):
    refused = assert_rejected(
        lambda: alice.deploy(name="broken", code=code), 400, "invalid_request", message_part=words
    )
    error = refused.json()["error"]
    assert error["message"].startswith("the runtime refused the script: Uncaught")
    assert not Capability.objects.exists() and not CapabilityVersion.objects.exists()
    assert alice.call("/alice/broken").status_code == 404


def test_a_class_default_export_and_named_entrypoints_still_serve(alice):
    code = """import { WorkerEntrypoint } from "cloudflare:workers";
export const other = { async fetch() { return new Response("other") } };
export default class extends WorkerEntrypoint { async fetch() { return new Response("hi from a class") } }"""
    deployed = alice.deploy(name="classy", code=code)
    assert deployed.status_code == 201, deployed.text
    assert alice.call("/alice/classy").text == "hi from a class"


def test_a_broken_new_version_keeps_the_old_one_serving_and_needs_no_cooldown_to_fix(alice, settings):
    assert alice.deploy(name="ping", code=PONG).status_code == 201  # no cool-down yet
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 60

    broken = alice.deploy(name="ping", code="export default { fetch() { return new Response('two') ")
    assert broken.status_code == 400
    assert alice.call("/alice/ping").text == "pong"
    assert Capability.objects.get(full_name="alice--ping").versions.count() == 1

    fixed = alice.deploy(name="ping", code="export default { fetch() { return new Response('two') } }")
    assert fixed.status_code == 200 and fixed.json()["version"] == 2
    assert alice.call("/alice/ping").text == "two"
    assert alice.deploy(name="ping", code=PONG).status_code == 429  # a real deploy still starts one
