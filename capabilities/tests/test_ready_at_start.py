"""A process that serves capabilities makes Sigil's own Worker ready as it starts: on a fresh
Cloudflare account (the emulator, reset) `/_health` is ok without `deployruntime` or a deploy."""

import pytest
import requests

from capabilities.workerd import free_port
from testsupport.servers import served

FRONT_WORKER = {"platform": "sigil-dispatcher", "loader": "sigil-loader"}


@pytest.mark.parametrize("backend", ["platform", "loader"])
def test_a_web_process_started_on_a_fresh_account_is_healthy(backend, cf_emulator_fresh, transactional_db, tmp_path):
    assert cf_emulator_fresh.api_calls() == []  # nothing on the account yet
    environment = {
        "SIGIL_BACKEND": backend,
        "CF_API_BASE": cf_emulator_fresh.api_base,
        "CF_ACCOUNT_ID": cf_emulator_fresh.account_id,
        "CF_API_TOKEN": cf_emulator_fresh.token,
        "SIGIL_CF_WORKERS_BASE": cf_emulator_fresh.url,
    }
    # `served` returns once /_health answers 200, and fails after a minute of 503s.
    with served("gunicorn", port=free_port(), environment=environment, log=tmp_path / "server.log") as url:
        health = requests.get(f"{url}/_health", timeout=30).json()
    assert health["status"] == "ok", health
    assert health["backend"] == backend
    uploads = cf_emulator_fresh.api_calls(method="PUT", path_suffix=f"/workers/scripts/{FRONT_WORKER[backend]}")
    assert [call["status"] for call in uploads] == [200]
