"""Cloudflare's propagation delays, emulated (`propagation_delay`), so the client's and the
runtimes' waiting and retry paths run: a new script and a workers.dev toggle reach the
Workers runtime some time after the API answered. (Workers KV's own propagation is
`kv_propagation_seconds`: test_kv.py.)"""

from __future__ import annotations

import time

import pytest

from cfemulator.tests.test_api import Api
from testsupport.capability_code import PONG
from testsupport.emulator import cloudflare_client

DELAY = 0.5


@pytest.fixture
def api(cf_emulator_fresh):
    cf_emulator_fresh.configure(propagation_delay=DELAY)
    return Api(cf_emulator_fresh)


def test_the_workers_dev_toggle_of_a_fresh_script_is_retried_through_its_10007(api, cf_emulator_fresh, redis_client):
    # Backoffs as in production: its two not-found retries outlast the delay.
    client = cloudflare_client(cf_emulator_fresh, redis_client, backoff_base_seconds=0.5)
    try:
        assert api.upload("fresh").status_code == 200
        assert client.script_subdomain_set("fresh", enabled=True)["enabled"] is True
    finally:
        client.close()
    toggles = cf_emulator_fresh.api_calls(method="POST", path_suffix="/fresh/subdomain")
    assert (toggles[0]["status"], toggles[0]["code"]) == (404, 10007)
    assert toggles[-1]["status"] == 200


def test_a_new_script_and_its_route_are_served_only_once_propagated(api, cf_emulator_fresh):
    host = cf_emulator_fresh.workers_dev_host("fresh")
    assert api.upload("fresh").status_code == 200
    assert api.enable("fresh").json()["errors"][0]["code"] == 10007
    time.sleep(DELAY)
    assert api.enable("fresh").status_code == 200
    assert cf_emulator_fresh.worker_request(host).status_code == 404  # the toggle propagates in turn
    time.sleep(DELAY)
    assert cf_emulator_fresh.worker_request(host).status_code == 200


def test_a_new_script_in_a_dispatch_namespace_is_served_at_once(api, cf_emulator_fresh):
    assert api.call("POST", "/workers/dispatch/namespaces", json={"name": "tenants"}).status_code == 200
    assert api.upload("fresh", namespace="tenants").status_code == 200
    # Unlike an account's new script (above): Cloudflare deploys a namespace's synchronously.
    assert cf_emulator_fresh.worker_request("fresh.tenants.dispatch.localhost").status_code == 200


@pytest.mark.parametrize("runtime", ["worker_pool", "platform", "loader"])
def test_a_capability_answers_its_first_call_while_cloudflare_propagates(runtime, request, alice):
    """The first placement uploads a new script (and on platform and loader, Sigil's own
    Worker): the deploy's start check and the first call wait for Cloudflare to serve it."""
    emulator = request.getfixturevalue(runtime)
    emulator.configure(propagation_delay=DELAY)
    deployed = alice.deploy(name="ping", code=PONG)
    assert deployed.status_code == 201, deployed.text
    response = alice.call("/alice/ping")
    assert (response.status_code, response.text) == (200, "pong"), dict(response.headers)
