"""No secret at rest in plain text: a capability that logs its bound secret, throws an error
naming it (when called, or at its start) or leaves a promise rejected with it, called
directly and asynchronously with a callback, leaves the value in none of the files Sigil and
its workerd processes write, in no log line, and in nothing written to Redis (what an
append-only file keeps), on every runtime (the Cloudflare ones against the emulator)."""

import json
import logging
import threading
from pathlib import Path

import pytest
import redis
from django.conf import settings

from agents.models import AuditEvent
from capabilities.models import Binding
from sigil.encryption import secret_encrypt
from testsupport.cast import grant, wait_for

SECRET = "plant-7f3c9e21-value"
MASKED = "[secret APIKEY]"
LEAKS = """export default { async fetch(request, env, ctx) {
  console.log('the key is', env.APIKEY);
  console.error({ key: env.APIKEY });
  console.assert(false, 'asserted with', env.APIKEY);
  ctx.waitUntil(Promise.reject(new Error('later: ' + env.APIKEY)));
  if (new URL(request.url).pathname.endsWith('/quiet')) return new Response('quiet');
  throw new Error('failed with ' + env.APIKEY);
} }"""
# Reads its secret at the top level, outside any handler, and fails to start with it.
FAILS_TO_START = """import { env } from "cloudflare:workers";
throw new Error('cannot start with ' + env.APIKEY);
export default { async fetch() { return new Response('never'); } };"""


@pytest.fixture(params=["local", "loader", "worker-pool", "platform"])
def on_runtime(request):
    """Sigil on each runtime in turn; the Cloudflare ones against the fresh emulator, whose
    logs of the Workers stand for Cloudflare's."""
    if request.param == "local":
        request.getfixturevalue("workerd_group")
        return request.param
    emulator = request.getfixturevalue(request.param.replace("-", "_"))
    if request.param == "worker-pool":
        # Sigil's Tail Worker is the system script the pool reserves a script of the account for.
        request.getfixturevalue("settings").SIGIL_LOGS_ENABLED = True
        emulator.configure(script_limit=8)
    return request.param


class RedisWrites:
    """Every command Redis runs while it watches (MONITOR), as text."""

    def __init__(self) -> None:
        self.commands: list[str] = []
        self._ready, self._done = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "RedisWrites":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        redis.Redis.from_url(settings.REDIS_URL).ping()  # one more command ends the watch
        self._thread.join(10)

    def _watch(self) -> None:
        with redis.Redis.from_url(settings.REDIS_URL).monitor() as monitor:
            self._ready.set()
            for command in monitor.listen():
                self.commands.append(command["command"])
                if self._done.is_set():
                    return


def files_holding(directory: Path, value: bytes) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file() and value in path.read_bytes()]


def test_a_logged_or_thrown_secret_is_written_nowhere(
    on_runtime, alice, redis_client, webhook_receiver, celery_worker, caplog, settings
):
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    caplog.set_level(logging.DEBUG)
    var = Path(settings.VAR_DIR)
    grant(Binding.objects.create(kind="SECRET", name="APIKEY", secret_encrypted=secret_encrypt(SECRET)), "alice")
    with RedisWrites() as writes:
        deployed = alice.deploy(name="leaky", code=LEAKS, bindings=["SECRET:APIKEY"])
        assert deployed.status_code in (200, 201), deployed.text
        refused = alice.deploy(name="unstarted", code=FAILS_TO_START, bindings=["SECRET:APIKEY"])
        assert refused.status_code == 400 and MASKED in refused.json()["error"]["message"], refused.text
        thrown = alice.call("/alice/leaky")
        assert thrown.status_code == 502 and MASKED in thrown.json()["error"]["message"]
        assert alice.call("/alice/leaky/quiet").text == "quiet"
        later = alice.call("/alice/leaky", headers={"Prefer": "respond-async", "X-Callback-Url": webhook_receiver.url})
        assert later.status_code == 202, later.text
        wait_for(lambda: webhook_receiver.received, timeout=30, message="the async call's callback")
        _, delivered = webhook_receiver.received[0]
        assert MASKED in json.loads(delivered)["result"]["body"]
        failures = alice.call("/_api/capabilities/alice--leaky", token="deploy").json()
        assert SECRET not in json.dumps(failures)

        def records_kept() -> bool:
            answer = alice.call("/_api/capabilities/alice--leaky/logs?limit=10").json()
            return len(answer["records"]) >= 3

        wait_for(records_kept, timeout=30, message="the calls' records")
        if on_runtime == "local":
            # What workerd printed reached its log file and Sigil's log, masked.
            wait_for(
                lambda: files_holding(var / "workerd", b"the key is " + MASKED.encode()),
                timeout=10,
                message="the console line in workerd's log file",
            )
            assert any(MASKED in r.getMessage() for r in caplog.records if r.name == "capabilities.workerd.output")

    assert [c for c in writes.commands if SECRET in c] == []
    assert [(r.name, r.getMessage()) for r in caplog.records if SECRET in r.getMessage()] == []
    assert files_holding(var, SECRET.encode()) == []
    trail = [(event.action, event.detail) for event in AuditEvent.objects.all()]
    assert trail and [entry for entry in trail if SECRET in json.dumps(entry)] == []
    for key in redis_client.scan_iter(count=1000):
        assert SECRET.encode() not in (redis_client.dump(key) or b""), key


def test_what_workerd_prints_is_masked_with_the_secrets_of_every_stored_bundle(tmp_path, caplog):
    """Whatever workerd prints past the console (its own errors, a line the host could not
    mask) is masked as it is relayed: the supervisor opens each bundle stored since it last
    looked, including one stored after the relay started."""
    import subprocess
    import sys

    from capabilities.runtimes.base import CodeBundle, ResolvedBinding
    from capabilities.workerd.host import _relay_output
    from capabilities.workerd.secrets import StoredSecrets

    def store(name: str, value: str) -> None:
        binding = ResolvedBinding(kind="SECRET", name=name, value=value, fingerprint=f"fp-{value}")
        bundle = CodeBundle.from_code("export default {}", bindings=[binding])
        (code_dir / f"{bundle.sha}.json").write_bytes(bundle.to_json(seal_key="host-secret"))

    caplog.set_level(logging.INFO, logger="capabilities.workerd.output")
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    store("APIKEY", SECRET)
    secrets = StoredSecrets(code_dir=code_dir, seal_key="host-secret")
    assert secrets.mask(f"x {SECRET} y") == f"x {MASKED} y"
    store("OTHER", "second-secret-4411")  # stored later: found at the next line
    printing = subprocess.Popen(
        [sys.executable, "-c", f"print('uncaught: {SECRET}'); print('and second-secret-4411 too')"],
        stdout=subprocess.PIPE,
    )
    log_path = tmp_path / "workerd.log"
    _relay_output(printing, log_path, 0, secrets)
    printing.wait(10)

    written = log_path.read_text()
    assert written == f"uncaught: {MASKED}\nand [secret OTHER] too\n"
    relayed = [r.getMessage() for r in caplog.records if r.name == "capabilities.workerd.output"]
    assert relayed == [f"uncaught: {MASKED}", "and [secret OTHER] too"]
    assert StoredSecrets(code_dir=code_dir, seal_key="another-key").mask(SECRET) == SECRET  # sealed for another host
