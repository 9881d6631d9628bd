"""The clients Cloudflare's users run, driving the emulator through a Worker's lifecycle as they
drive Cloudflare: the official `cloudflare` SDK and wrangler (from node_modules)."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import cloudflare
import pytest
import requests

WORKER = "export default { async fetch(request, env) { return new Response('v1 ' + (env.TOKEN ?? '-')) } }"
WORKER_V2 = "export default { async fetch(request, env) { return new Response('v2 ' + (env.TOKEN ?? '-')) } }"
DATE = "2025-01-01"
WRANGLER = Path(__file__).resolve().parents[2] / "node_modules" / ".bin" / "wrangler"


@pytest.fixture
def sdk(cf_emulator_fresh) -> cloudflare.Cloudflare:
    # No retries: a refusal must show as the emulator gave it, not as a client's last attempt.
    return cloudflare.Cloudflare(api_token=cf_emulator_fresh.token, base_url=cf_emulator_fresh.api_base, max_retries=0)


def _module(code: str) -> tuple[str, bytes, str]:
    return ("worker.js", code.encode(), "application/javascript+module")


def _sdk_upload(sdk, account: str, name: str, **metadata):
    return sdk.workers.scripts.update(
        name,
        account_id=account,
        metadata={"main_module": "worker.js", "compatibility_date": DATE, **metadata},
        files=[_module(WORKER)],
    )


def test_the_sdk_drives_a_script_through_its_lifecycle(cf_emulator_fresh, sdk):
    emulator, account, name = cf_emulator_fresh, cf_emulator_fresh.account_id, "lifecycle"
    scripts = sdk.workers.scripts
    uploaded = _sdk_upload(sdk, account, name)
    assert uploaded.id == name
    scripts.subdomain.create(name, account_id=account, enabled=True)
    host = emulator.workers_dev_host(name)
    assert emulator.worker_request(host).text == "v1 -"

    # The code alone: read back, replaced, and served; the date stays as uploaded.
    assert scripts.content.get(name, account_id=account).text() == WORKER
    scripts.content.update(name, account_id=account, metadata={"main_module": "worker.js"}, files=[_module(WORKER_V2)])
    assert scripts.content.get(name, account_id=account).text() == WORKER_V2
    assert emulator.worker_request(host).text == "v2 -"
    assert scripts.script_and_version_settings.get(name, account_id=account).compatibility_date == DATE

    # Script-level settings.
    settings = scripts.settings.edit(name, account_id=account, logpush=True, tags=["team:a"])
    assert settings.logpush is True and settings.tags == ["team:a"]
    assert scripts.settings.get(name, account_id=account).tags == ["team:a"]

    # Secrets: set, listed by name only, served, deleted.
    scripts.secrets.update(name, account_id=account, name="TOKEN", text="s3cret", type="secret_text")
    assert [(s.name, s.type) for s in scripts.secrets.list(name, account_id=account)] == [("TOKEN", "secret_text")]
    assert emulator.worker_request(host).text == "v2 s3cret"
    scripts.secrets.delete("TOKEN", account_id=account, script_name=name)
    assert list(scripts.secrets.list(name, account_id=account)) == []
    assert emulator.worker_request(host).text == "v2 -"
    with pytest.raises(cloudflare.NotFoundError) as missing:
        scripts.secrets.delete("TOKEN", account_id=account, script_name=name)
    assert missing.value.body["errors"][0]["code"] == 10056

    # Deployments: one per change (upload, code, secret set, secret deleted), newest first,
    # each giving one version all traffic; a version deploys again (a rollback).
    listed = scripts.deployments.with_raw_response.list(name, account_id=account).http_response.json()
    deployments = listed["result"]["deployments"]
    assert len(deployments) == 4
    assert all(d["strategy"] == "percentage" and d["versions"][0]["percentage"] == 100 for d in deployments)
    first_version = deployments[-1]["versions"][0]["version_id"]
    rollback = scripts.deployments.create(
        name,
        account_id=account,
        strategy="percentage",
        versions=[{"version_id": first_version, "percentage": 100}],
        annotations={"workers/message": "back to v1"},
    )
    assert rollback.versions[0].version_id == first_version
    assert emulator.worker_request(host).text == "v1 -"
    # Read raw: cloudflare 5.9's model of a version's bindings does not build under pydantic 2.14.
    version = scripts.versions.with_raw_response.get(first_version, account_id=account, script_name=name)
    assert version.http_response.json()["result"]["number"] == 1

    # Account settings.
    assert sdk.workers.account_settings.get(account_id=account).default_usage_model == "standard"
    sdk.workers.account_settings.update(account_id=account, green_compute=True)
    assert sdk.workers.account_settings.get(account_id=account).green_compute is True

    scripts.delete(name, account_id=account)
    with pytest.raises(cloudflare.NotFoundError):
        scripts.settings.get(name, account_id=account)


def test_a_version_is_served_once_deployed_and_only_whole(cf_emulator_fresh, sdk):
    emulator, account, name = cf_emulator_fresh, cf_emulator_fresh.account_id, "versioned"
    scripts = sdk.workers.scripts
    _sdk_upload(sdk, account, name)
    scripts.subdomain.create(name, account_id=account, enabled=True)
    host = emulator.workers_dev_host(name)
    # Read raw, as cloudflare 5.9's model of a version's bindings does not build.
    created = scripts.versions.with_raw_response.create(
        name,
        account_id=account,
        metadata={"main_module": "worker.js", "compatibility_date": DATE},
        files=[_module(WORKER_V2)],
    ).http_response.json()["result"]
    assert created["number"] == 2
    assert emulator.worker_request(host).text == "v1 -"  # uploaded, not deployed

    first = scripts.deployments.with_raw_response.list(name, account_id=account).http_response.json()
    first_version = first["result"]["deployments"][0]["versions"][0]["version_id"]
    with pytest.raises(cloudflare.BadRequestError) as split:
        scripts.deployments.create(
            name,
            account_id=account,
            strategy="percentage",
            versions=[{"version_id": first_version, "percentage": 50}, {"version_id": created["id"], "percentage": 50}],
        )
    assert split.value.body["errors"][0]["code"] == 10021
    assert emulator.worker_request(host).text == "v1 -"

    scripts.deployments.create(
        name, account_id=account, strategy="percentage", versions=[{"version_id": created["id"], "percentage": 100}]
    )
    assert emulator.worker_request(host).text == "v2 -"


def test_the_sdk_reads_the_user_its_accounts_and_memberships(cf_emulator_fresh, sdk):
    account = cf_emulator_fresh.account_id
    assert sdk.user.get().email  # whom the token belongs to
    assert [a.id for a in sdk.accounts.list()] == [account]
    assert sdk.accounts.get(account_id=account).id == account
    memberships = list(sdk.memberships.list())
    assert [m.account.id for m in memberships] == [account] and memberships[0].status == "accepted"


def test_the_sdk_writes_reads_and_deletes_kv_in_bulk(cf_emulator_fresh, sdk):
    account = cf_emulator_fresh.account_id
    namespaces = sdk.kv.namespaces
    namespace = namespaces.create(account_id=account, title="bulk").id
    written = namespaces.bulk_update(
        namespace,
        account_id=account,
        body=[{"key": "a", "value": "1"}, {"key": "b", "value": '{"n": 2}', "metadata": {"m": True}}],
    )
    assert written.successful_key_count == 2
    text = namespaces.bulk_get(namespace, account_id=account, keys=["a", "b", "missing"])
    assert text.values == {"a": "1", "b": '{"n": 2}', "missing": None}
    parsed = namespaces.with_raw_response.bulk_get(
        namespace, account_id=account, keys=["b"], type="json", with_metadata=True
    ).http_response.json()
    assert parsed["result"]["values"]["b"] == {"value": {"n": 2}, "metadata": {"m": True}, "expiration": None}
    namespaces.bulk_delete(namespace, account_id=account, body=["a", "b"])
    assert namespaces.bulk_get(namespace, account_id=account, keys=["a", "b"]).values == {"a": None, "b": None}


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"compatibility_date": "2999-01-01"}, "Can't set compatibility date in the future: 2999-01-01"),
        ({"compatibility_flags": ["no_such_flag_at_all"]}, "No such compatibility flag: no_such_flag_at_all"),
    ],
)
def test_compatibility_is_checked_as_cloudflare_checks_it(cf_emulator_fresh, sdk, metadata, message):
    emulator = cf_emulator_fresh
    with pytest.raises(cloudflare.BadRequestError) as refused:
        _sdk_upload(sdk, emulator.account_id, "compat", **metadata)
    assert refused.value.body["errors"] == [{"code": 10021, "message": message}]

    meta = {"main_module": "worker.js", "compatibility_date": DATE, **metadata}
    raw = requests.put(
        f"{emulator.api_base}/accounts/{emulator.account_id}/workers/scripts/compat",
        headers={"Authorization": f"Bearer {emulator.token}"},
        files=[("metadata", (None, json.dumps(meta))), ("worker.js", _module(WORKER))],
        timeout=30,
    )
    assert raw.status_code == 400
    assert raw.json()["errors"] == [{"code": 10021, "message": message}]
    assert emulator.api_calls(method="PUT", path_suffix="/compat")  # both reached the emulator


def test_today_and_known_flags_upload(cf_emulator_fresh, sdk, settings):
    # The runtime's own release date bounds "today", as it runs no later date.
    yesterday = (datetime.now(UTC) - timedelta(days=1)).date().isoformat()
    runtime = subprocess.run(
        [settings.SIGIL_WORKERD_BIN, "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    date = min(yesterday, runtime)
    uploaded = _sdk_upload(
        sdk, cf_emulator_fresh.account_id, "today", compatibility_date=date, compatibility_flags=["nodejs_compat"]
    )
    assert uploaded.id == "today"


def test_unsupported_calls_answer_as_an_unknown_route(cf_emulator_fresh):
    emulator = cf_emulator_fresh
    answer = requests.get(
        f"{emulator.api_base}/accounts/{emulator.account_id}/workers/scripts/any/schedules",
        headers={"Authorization": f"Bearer {emulator.token}"},
        timeout=10,
    )
    assert answer.status_code == 404
    assert answer.json()["errors"] == [{"code": 7003, "message": "No route for the URI"}]


# --- wrangler ---------------------------------------------------------------------------------


def _wrangler(emulator, project: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(project),
        "XDG_CONFIG_HOME": str(project / ".config"),
        "CLOUDFLARE_API_BASE_URL": emulator.api_base,
        "CLOUDFLARE_API_TOKEN": emulator.token,
        "CLOUDFLARE_ACCOUNT_ID": emulator.account_id,
        # No telemetry, error reports or update checks: only the emulator is spoken to, and a
        # request anywhere else meets a proxy that is not there.
        "WRANGLER_SEND_METRICS": "false",
        "WRANGLER_SEND_ERROR_REPORTS": "false",
        "WRANGLER_HIDE_BANNER": "true",
        "CI": "1",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    return subprocess.run(
        [str(WRANGLER), *args], cwd=project, env=env, input=stdin, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_wrangler_deploys_redeploys_lists_and_deletes(cf_emulator_fresh, tmp_path):
    emulator = cf_emulator_fresh
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "index.js").write_text(WORKER)
    config = {"name": "wrangled", "main": "src/index.js", "compatibility_date": DATE, "workers_dev": True}
    (tmp_path / "wrangler.json").write_text(json.dumps(config))

    def run(*args: str, stdin: str | None = None) -> str:
        done = _wrangler(emulator, tmp_path, *args, stdin=stdin)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    whoami = run("whoami")
    assert emulator.account_id in whoami

    host = emulator.workers_dev_host("wrangled")
    run("deploy")  # the first: a script upload
    assert emulator.worker_request(host).text == "v1 -"
    run("secret", "put", "TOKEN", stdin="s3cret\n")
    assert emulator.worker_request(host).text == "v1 s3cret"
    assert [s["name"] for s in json.loads(run("secret", "list", "--format", "json"))] == ["TOKEN"]
    (tmp_path / "src" / "index.js").write_text(WORKER_V2)
    run("deploy")  # the next: a version, then a deployment of it, the secret kept
    assert emulator.worker_request(host).text == "v2 s3cret"
    assert emulator.api_calls(method="POST", path_suffix="/wrangled/versions")

    # Three deployments (deploy, secret, deploy), each of its own version.
    deployments = json.loads(run("deployments", "list", "--json"))
    assert len(deployments) == 3
    versions = json.loads(run("versions", "list", "--json"))
    assert len(versions) == 3

    run("delete", "--force")
    answer = emulator.worker_request(emulator.workers_dev_host("wrangled"))
    assert answer.status_code == 404
    assert not [call for call in emulator.api_calls() if call["code"] == 7003]
