"""Secrets in a code bundle are stored sealed for the loader host, and opened by it in workerd."""

import json
import threading

import pytest

from capabilities.runtimes.base import CodeBundle, ResolvedBinding, secret_fingerprint
from capabilities.runtimes.errors import RuntimeUnavailable
from capabilities.runtimes.local import LocalProcesses, LocalRuntime, local_limits
from capabilities.tests.runtimes.contract import call
from sigil.ports import free_port_block
from testsupport.processes import wait_until

SHOWS_TOKEN = "export default { fetch(r, env) { return Response.json({ token: env.TOKEN, greeting: env.GREETING }) } }"


def bundle_with(token: str) -> CodeBundle:
    return CodeBundle.from_code(
        SHOWS_TOKEN,
        bindings=[
            ResolvedBinding("VAR", "GREETING", "hi"),
            ResolvedBinding("SECRET", "TOKEN", token, fingerprint=secret_fingerprint(token, key="test-key")),
        ],
    )


def serving(runtime: LocalRuntime) -> bool:
    try:
        runtime.check()
    except RuntimeUnavailable:
        return False
    return True


@pytest.fixture
def host_for(settings, tmp_path):
    """Start the local runtime's supervised workerd processes with a given secret, every
    group reading one code directory."""
    stops = []

    def start(secret: str) -> LocalRuntime:
        processes = LocalProcesses(state_dir=tmp_path / f"workerd-{len(stops)}", base_port=free_port_block())
        group = processes.group(
            code_dir=tmp_path / "code",
            binary=settings.SIGIL_WORKERD_BIN,
            secret=secret,
            limits=local_limits(cpu_ms=settings.SIGIL_CPU_MS, memory_mb=settings.SIGIL_WORKERD_MEMORY_MB),
            own_session=True,
        )
        stop = threading.Event()
        thread = threading.Thread(target=group.run, args=(stop,), daemon=True)
        thread.start()
        stops.append((stop, thread))
        runtime = LocalRuntime(code_dir=tmp_path / "code", processes=processes, secret=secret)
        # A group over a code store with placements starts their agents' processes at once.
        wait_until(lambda: serving(runtime), timeout=15, what="the workerd processes serving")
        return runtime

    yield start
    for stop, thread in stops:
        stop.set()
        thread.join(30)


def test_the_code_store_holds_the_secret_sealed_and_the_host_opens_it(host_for):
    runtime = host_for("first-host-secret")
    bundle = bundle_with("token-value-for-the-host")
    runtime.place(slot="alice--token", tenant="alice", bundle=bundle)
    stored = (runtime.code_dir / f"{bundle.sha}.json").read_bytes()
    assert b"token-value-for-the-host" not in stored
    assert json.loads(stored)["env"] == {"GREETING": "hi"} and "sealed" in json.loads(stored)
    route = runtime.route(slot="alice--token", tenant="alice", sha=bundle.sha)
    assert call(route).json() == {"token": "token-value-for-the-host", "greeting": "hi"}


def test_a_bundle_sealed_for_another_host_secret_is_missing_until_placed_again(host_for):
    bundle = bundle_with("token-value-across-a-rotation")
    host_for("secret-before-rotation").place(slot="alice--token", tenant="alice", bundle=bundle)
    rotated = host_for("secret-after-rotation")  # same code store, another internal secret
    route = rotated.route(slot="alice--token", tenant="alice", sha=bundle.sha)
    missing = call(route)
    assert (missing.status, missing.headers["x-sigil-error"]) == (404, "missing-code")
    assert b"token-value" not in missing.data
    rotated.place(slot="alice--token", tenant="alice", bundle=bundle)  # what the gateway does on a miss
    assert call(route).json()["token"] == "token-value-across-a-rotation"


def test_the_sha_follows_the_secret_but_not_the_seal():
    one, same, other = bundle_with("one"), bundle_with("one"), bundle_with("two")
    assert one.sha == same.sha != other.sha
    assert one.to_json(seal_key="k") != one.to_json(seal_key="k")  # a fresh nonce each time
    with pytest.raises(ValueError, match="fingerprint"):
        CodeBundle.from_code(SHOWS_TOKEN, bindings=[ResolvedBinding("SECRET", "TOKEN", "no fingerprint")])
