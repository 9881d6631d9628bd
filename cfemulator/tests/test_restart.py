"""The emulated account outlives the emulator's process, as a Cloudflare account outlives
any client: a restart between a deploy and a call changes nothing Sigil can see."""

from __future__ import annotations

import pytest

from capabilities.models import Binding
from cfemulator.server import EmulatorServer
from cfemulator.tests.test_api import Api, kv_binding
from sigil.encryption import secret_encrypt
from sigil.ports import free_port
from testsupport.capability_code import PONG
from testsupport.cast import grant
from testsupport.emulator import EmulatorControl, emulator_server

KV_AND_SECRET = """export default { async fetch(request, env) {
  if (request.method === "PUT") { await env.STORE.put("k", await request.text()); return new Response("stored"); }
  return new Response(`${await env.STORE.get("k")} ${env.TOKEN}`);
} }"""


class RestartableEmulator:
    """An emulator of its own on a fixed port and state directory, which a test can restart."""

    def __init__(self, state_dir, workerd_binary: str) -> None:
        self.state_dir = state_dir
        self.workerd_binary = workerd_binary
        self.port = free_port()
        self.server: EmulatorServer | None = None
        self.start()
        self.control = EmulatorControl.of(self.server)

    def start(self) -> None:
        self.server = emulator_server(workerd_binary=self.workerd_binary, state_dir=self.state_dir, port=self.port)
        self.server.start()

    def restart(self) -> None:
        self.server.stop()
        self.start()


@pytest.fixture
def emulator(settings, tmp_path, celery_deploy_worker):
    """An emulator of this test's own, which Sigil's Cloudflare runtimes use; deploys on them
    are placed by the session's deploy worker."""
    handle = RestartableEmulator(tmp_path / "cfemulator", settings.SIGIL_WORKERD_BIN)
    settings.CF_API_BASE = handle.control.api_base
    settings.CF_ACCOUNT_ID = handle.control.account_id
    settings.CF_API_TOKEN = handle.control.token
    settings.SIGIL_CF_WORKERS_BASE = handle.control.url
    yield handle
    handle.server.stop()


@pytest.mark.parametrize("backend", ["platform", "worker-pool"])
def test_a_capability_deployed_before_a_restart_answers_after_it(emulator, backend, alice, settings):
    settings.SIGIL_BACKEND = backend
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    assert alice.call("/alice/ping").text == "pong"
    emulator.restart()
    response = alice.call("/alice/ping")
    assert (response.status_code, response.text) == (200, "pong")
    assert "X-Sigil-Cold-Start" not in response.headers  # found where it was, not placed again


SHOWS_TOKEN = "export default { async fetch(request, env) { return new Response(env.TOKEN) } }"
PLANTED = "planted-secret-4f9c2e7a1b"


def files_holding(directory, value: str) -> list[str]:
    """Every file under `directory` whose bytes contain `value`."""
    return [str(path) for path in directory.rglob("*") if path.is_file() and value.encode() in path.read_bytes()]


@pytest.mark.parametrize("backend", ["worker-pool", "platform", "loader"])
def test_secrets_are_sealed_in_every_file_the_emulator_keeps_and_opened_again_at_start(
    emulator, backend, alice, settings
):
    settings.SIGIL_BACKEND = backend
    token = Binding.objects.create(kind="SECRET", name="TOKEN", secret_encrypted=secret_encrypt(PLANTED))
    grant(token, "alice")
    assert alice.deploy(name="shows", code=SHOWS_TOKEN, bindings=["SECRET:TOKEN"]).status_code == 201
    assert alice.call("/alice/shows").text == PLANTED
    # The capability's secret, and Sigil's own (its Workers' SIGIL_GUARD_SECRET,
    # SIGIL_DISPATCH_SECRET or SIGIL_SECRET), are in no file: neither while the emulator serves
    # nor once stopped.
    for value in (PLANTED, settings.SIGIL_INTERNAL_SECRET):
        assert files_holding(emulator.state_dir, value) == []
    emulator.server.stop()
    for value in (PLANTED, settings.SIGIL_INTERNAL_SECRET):
        assert files_holding(emulator.state_dir, value) == []

    emulator.start()
    response = alice.call("/alice/shows")
    assert (response.status_code, response.text) == (200, PLANTED)
    assert "X-Sigil-Cold-Start" not in response.headers  # its own upload, opened again


def test_kv_values_secrets_and_workers_dev_routes_survive_a_restart(emulator):
    api = Api(emulator.control)
    namespace = api.kv_namespace()
    bindings = [
        kv_binding(namespace),
        {"type": "secret_text", "name": "TOKEN", "text": "s3cr3t"},
    ]
    assert api.upload("keeper", KV_AND_SECRET, metadata={"bindings": bindings}).status_code == 200
    api.enable("keeper")
    host = emulator.control.workers_dev_host("keeper")
    assert emulator.control.worker_request(host, method="PUT", data=b"kept").text == "stored"

    emulator.restart()

    # Read through the binding, with the secret sealed again for the new run's workerd.
    assert emulator.control.worker_request(host).text == "kept s3cr3t"
    listed = api.call("GET", "/workers/scripts").json()["result"]
    assert [script["id"] for script in listed] == ["keeper"]


def test_a_reset_is_not_undone_by_a_restart(emulator):
    api = Api(emulator.control)
    assert api.upload("gone").status_code == 200
    emulator.control.reset()
    emulator.restart()
    assert api.call("GET", "/workers/scripts").json()["result"] == []


def test_switchbackend_after_a_restart_moves_what_was_deployed_before_it(emulator, alice, settings, sigil, monkeypatch):
    import io

    from django.core.management import call_command

    from capabilities.runtimes import runtimes_forget

    settings.SIGIL_BACKEND = "platform"
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    emulator.restart()
    # What the owner does: change SIGIL_BACKEND, restart Sigil, then switch.
    settings.SIGIL_BACKEND = "loader"
    monkeypatch.setenv("SIGIL_BACKEND", "loader")  # in the shell switchbackend runs from
    runtimes_forget()
    sigil.app.gateway = None
    call_command("switchbackend", stdout=io.StringIO())
    response = alice.call("/alice/ping")
    assert (response.status_code, response.text) == (200, "pong")


def test_a_capability_left_on_a_runtime_that_is_gone_says_how_to_move_it(emulator, alice, settings, sigil):
    from capabilities.runtimes import runtimes_forget

    settings.SIGIL_BACKEND = "platform"
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    emulator.server.stop()  # the runtime it was placed on is gone
    try:
        # The owner changed SIGIL_BACKEND and restarted Sigil, but has not run switchbackend yet.
        settings.SIGIL_BACKEND = "local"
        runtimes_forget()
        sigil.app.gateway = None
        response = alice.call("/alice/ping")
        assert response.status_code == 502, response.text
        message = response.json()["error"]["message"]
        assert "still placed on the platform runtime, not local" in message
        assert "`SIGIL_BACKEND=local python manage.py switchbackend`" in message
    finally:
        emulator.start()


def test_health_and_the_capability_page_say_what_is_left_on_a_runtime_that_is_gone(emulator, alice, settings, sigil):
    import requests
    from django.contrib.auth import get_user_model
    from django.test import Client

    from capabilities.models import Capability
    from capabilities.runtimes import runtimes_forget

    settings.SIGIL_BACKEND = "platform"
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    capability = Capability.objects.get(full_name="alice--ping")
    owner = Client()
    owner.force_login(get_user_model().objects.create_superuser("owner", "owner@example.invalid", "pw"))
    page = owner.get(f"/admin/capabilities/capability/{capability.pk}/change/").content.decode()
    assert 'id="runtime"' in page and "platform" in page and 'id="runtime-warning"' not in page

    settings.SIGIL_BACKEND = "local"  # the owner changed SIGIL_BACKEND and restarted Sigil...
    runtimes_forget()
    sigil.app.gateway = None
    answered = requests.get(f"{sigil.url}/_health", timeout=30)
    assert answered.status_code == 200, answered.text  # ... the platform still answers: served there
    assert answered.json()["left_on_previous_runtimes"] == {"platform": 1}
    page = owner.get(f"/admin/capabilities/capability/{capability.pk}/change/").content.decode()
    assert 'id="runtime-warning"' in page and "<code>SIGIL_BACKEND=local python manage.py switchbackend</code>" in page

    emulator.server.stop()  # ... and then the runtime it was placed on is gone
    try:
        runtimes_forget()
        answered = requests.get(f"{sigil.url}/_health", timeout=30)
        assert answered.status_code == 503, answered.text
        check = answered.json()["checks"]["previous_runtimes"]
        assert check.startswith("failing: 1 capabilities are still placed on the platform runtime, which does not")
        assert "`SIGIL_BACKEND=local python manage.py switchbackend`" in check and "object at 0x" not in check
        page = owner.get(f"/admin/capabilities/capability/{capability.pk}/change/").content.decode()
        assert "does not answer" in page
    finally:
        emulator.start()
