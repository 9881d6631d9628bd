"""Behaviours of Cloudflare's API and runtime that a kinder emulator would hide, each held
against Cloudflare's schema (cloudflare/api-schemas), Wrangler 4.x and cloudflare-python."""

from __future__ import annotations

import time

import pytest

from cfemulator.tests.test_api import ECHO, Api, first_error, kv_binding


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


def test_keep_bindings_carries_the_previous_uploads_secrets_over(api, cf_emulator_fresh):
    secret = {"type": "secret_text", "name": "TOKEN", "text": "s3cr3t"}
    greeting = {"type": "plain_text", "name": "GREETING", "text": "old"}
    assert api.upload("echo", ECHO, metadata={"bindings": [secret, greeting]}).status_code == 200
    api.enable("echo")
    renewed = {"type": "plain_text", "name": "GREETING", "text": "new"}
    # Wrangler's deploy: the secrets set apart (`wrangler secret put`) are kept by type.
    kept = api.upload("echo", ECHO, metadata={"bindings": [renewed], "keep_bindings": ["secret_text"]})
    assert kept.status_code == 200, kept.text
    seen = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("echo")).json()
    assert (seen["env"], seen["greeting"]) == (["GREETING", "TOKEN"], "new")
    names = [b["name"] for b in api.call("GET", "/workers/scripts/echo/settings").json()["result"]["bindings"]]
    assert sorted(names) == ["GREETING", "TOKEN"]

    # Without keep_bindings an upload's bindings are all the script has.
    assert api.upload("echo", ECHO, metadata={"bindings": [renewed]}).status_code == 200
    seen = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("echo")).json()
    assert seen["env"] == ["GREETING"]


def test_keep_bindings_is_a_list_of_binding_types(api):
    refused = api.upload("echo", ECHO, metadata={"keep_bindings": "secret_text"})
    assert (refused.status_code, first_error(refused)) == (400, 10021)
    assert api.upload("echo", ECHO, metadata={"keep_bindings": ["no_such_type"]}).status_code == 200


def test_every_upload_answers_a_fresh_deployment_id(api):
    first = api.upload("hello").json()["result"]
    second = api.upload("hello").json()["result"]
    assert first["deployment_id"] and second["deployment_id"]
    assert first["deployment_id"] != second["deployment_id"]
    assert first["startup_time_ms"] == 0


def test_the_account_script_list_filters_by_tags(api):
    api.upload("pooled", metadata={"tags": ["sigil", "sha-1"]})
    api.upload("owners")

    def listed(tags: str) -> list[str]:
        scripts = api.call("GET", "/workers/scripts", params={"tags": tags}).json()["result"]
        return sorted(script["id"] for script in scripts)

    assert listed("sigil:yes") == ["pooled"]
    assert listed("sigil:no") == ["owners"]
    assert listed("") == ["owners", "pooled"]


def test_the_workers_dev_subdomain_endpoints_agree_while_a_new_script_propagates(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(propagation_delay=0.5)
    api.upload("fresh")
    get = api.call("GET", "/workers/scripts/fresh/subdomain")
    post = api.enable("fresh")
    delete = api.call("DELETE", "/workers/scripts/fresh/subdomain")
    assert [(r.status_code, first_error(r)) for r in (get, post, delete)] == [(404, 10007)] * 3
    time.sleep(0.5)
    assert api.call("GET", "/workers/scripts/fresh/subdomain").json()["result"]["enabled"] is False
    assert api.enable("fresh").json()["result"]["enabled"] is True


def test_a_scripts_answer_carries_no_header_of_the_emulators(api, cf_emulator_fresh):
    api.upload("hello")
    api.enable("hello")
    answer = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("hello"))
    assert answer.status_code == 200
    assert not [name for name in answer.headers if name.lower().startswith(("x-sigil", "x-cfemulator"))]


def test_a_kv_miss_is_cached_where_it_was_read_as_cloudflare_caches_it(api, cf_emulator_fresh):
    # The miss cache alone: a value read is not held (test_kv.py holds it).
    cf_emulator_fresh.configure(kv_miss_cache_seconds=1.0, kv_propagation_seconds=0)
    reads = """export default { async fetch(request, env) {
      if (request.method === "PUT") { await env.STORE.put("k", "mine"); return new Response("put"); }
      return new Response(String(await env.STORE.get("k")));
    } }"""
    namespace = api.kv_namespace()
    bindings = [kv_binding(namespace)]
    assert api.upload("reader", reads, metadata={"bindings": bindings}).status_code == 200
    api.enable("reader")
    host = cf_emulator_fresh.workers_dev_host("reader")
    assert cf_emulator_fresh.worker_request(host).text == "null"
    missed_at = time.monotonic()

    api.call("PUT", f"/storage/kv/namespaces/{namespace}/values/k", data=b"written")
    assert api.call("GET", f"/storage/kv/namespaces/{namespace}/values/k").content == b"written"
    assert cf_emulator_fresh.worker_request(host).text == "null"  # the miss is still cached there
    time.sleep(max(0.0, 1.0 - (time.monotonic() - missed_at)))
    assert cf_emulator_fresh.worker_request(host).text == "written"

    # A write through the binding is seen where it was made at once, cached miss or not.
    api.call("DELETE", f"/storage/kv/namespaces/{namespace}/values/k")
    assert cf_emulator_fresh.worker_request(host).text == "null"
    assert cf_emulator_fresh.worker_request(host, method="PUT").text == "put"
    assert cf_emulator_fresh.worker_request(host).text == "mine"


def test_kv_misses_are_cached_for_cloudflares_60_seconds_by_default(cf_emulator_fresh):
    assert cf_emulator_fresh.config()["kv_miss_cache_seconds"] == 60


def test_deletes_can_be_answered_without_a_body(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(empty_delete_answers=True)
    api.upload("gone")
    deleted = api.call("DELETE", "/workers/scripts/gone")
    assert (deleted.status_code, deleted.content) == (200, b"")
    assert api.call("GET", "/workers/scripts").json()["result"] == []
