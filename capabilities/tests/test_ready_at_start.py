"""A process that serves capabilities makes Sigil's own Worker ready as it starts: on a fresh
Cloudflare account (the emulator, reset) `/_health` is ok without `deployruntime` or a deploy."""

import os
import subprocess
import sys

import pytest
import requests

from sigil.ports import free_port
from testsupport.processes import wait_until
from testsupport.servers import ROOT, database_url, served

FRONT_WORKER = {"platform": "sigil-dispatcher", "loader": "sigil-loader"}


def on_emulator(backend: str, emulator) -> dict[str, str]:
    return {
        "SIGIL_BACKEND": backend,
        "CF_API_BASE": emulator.api_base,
        "CF_ACCOUNT_ID": emulator.account_id,
        "CF_API_TOKEN": emulator.token,
        "SIGIL_CF_WORKERS_BASE": emulator.url,
    }


@pytest.mark.parametrize("backend", ["platform", "loader"])
def test_a_web_process_started_on_a_fresh_account_is_healthy(backend, cf_emulator_fresh, transactional_db, tmp_path):
    assert cf_emulator_fresh.api_calls() == []  # nothing on the account yet
    environment = on_emulator(backend, cf_emulator_fresh)
    # `served` returns once /_health answers 200, and fails after a minute of 503s.
    with served("uvicorn", port=free_port(), environment=environment, log=tmp_path / "server.log") as url:
        health = requests.get(f"{url}/_health", timeout=30).json()
    assert health["status"] == "ok", health
    assert health["backend"] == backend
    uploads = cf_emulator_fresh.api_calls(method="PUT", path_suffix=f"/workers/scripts/{FRONT_WORKER[backend]}")
    assert [call["status"] for call in uploads] == [200]


def test_a_celery_worker_alone_deploys_the_dispatch_worker_as_it_starts(cf_emulator_fresh, transactional_db, tmp_path):
    from django.db import connection

    env = {
        **os.environ,
        **on_emulator("platform", cf_emulator_fresh),
        "DATABASE_URL": database_url(connection.settings_dict),
    }
    worker = [sys.executable, "-m", "celery", "-A", "sigil_site", "worker", "--pool", "solo"]
    worker += ["--without-mingle", "--without-gossip", "--hostname", f"ready-{os.getpid()}@test"]
    with (tmp_path / "celery.log").open("wb") as log:
        process = subprocess.Popen(worker, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # Deployed and serving: the dispatch Worker refuses Sigil's request without its secret
        # (empty: with the edge on, a request without the header at all is a caller's).
        host = cf_emulator_fresh.workers_dev_host(FRONT_WORKER["platform"])
        unsigned = {"X-Sigil-Dispatch-Secret": ""}
        wait_until(
            lambda: cf_emulator_fresh.worker_request(host, headers=unsigned).status_code == 403,
            timeout=60,
            interval=0.5,
            what="the Celery worker to deploy the dispatch Worker",
        )
    finally:
        process.terminate()
        process.wait(timeout=30)
