"""`manage.py cfcheck` against the emulator: a good account, and accounts set up wrong."""

import io
import json

import pytest
from django.core.management import CommandError, call_command

from capabilities.services.cfcheck import LOADER_PROBE_SCRIPT


def cfcheck(backend: str) -> tuple[str, bool]:
    """The command's output, and whether it exited with success."""
    out = io.StringIO()
    try:
        call_command("cfcheck", backend=backend, stdout=out)
    except CommandError as exc:
        return out.getvalue() + str(exc), False
    return out.getvalue(), True


def lines(output: str) -> dict[str, str]:
    """topic -> its mark (ok, MISSING), from the command's output."""
    found = {}
    for line in output.splitlines():
        mark, _, rest = line.partition(" ")
        topic = rest.strip().partition(":")[0]
        if mark in ("ok", "MISSING"):
            found[topic] = mark
    return found


@pytest.mark.parametrize("edge", [True, False])
@pytest.mark.parametrize("backend", ["platform", "loader", "worker-pool"])
def test_a_good_account_is_ready_for_each_runtime(backend, edge, cf_settings, cf_emulator_fresh, redis_client):
    cf_settings.SIGIL_EDGE = edge
    output, ok = cfcheck(backend)
    assert ok, output
    what_the_edge_needs = {"edge KV namespace": "ok", "edge origin": "ok"} if edge else {}
    assert lines(output) == {
        "API token": "ok",
        "account": "ok",
        "workers.dev subdomain": "ok",
        "plan": "ok",
        "scripts": "ok",
        **what_the_edge_needs,
    }
    assert f"{cf_emulator_fresh.subdomain}.workers.dev" in output
    assert f"the {backend} runtime can work" in output


def test_the_edge_needs_an_origin_url(cf_settings, cf_emulator_fresh, redis_client):
    cf_settings.SIGIL_EDGE = True
    cf_settings.SIGIL_ORIGIN_URL = ""
    output, ok = cfcheck("platform")
    assert not ok
    assert lines(output)["edge origin"] == "MISSING"
    assert "SIGIL_ORIGIN_URL is empty" in output


@pytest.mark.parametrize(
    ("origin", "ok", "blocking"),
    [
        ("https://sigil.example.com", True, True),
        ("http://sigil.example.com", False, False),  # worth a note: calls would travel unencrypted
        ("http://127.0.0.1:8000", False, True),
        ("http://10.1.2.3", False, True),
        ("http://sigil.localhost:8000", False, True),
        ("https://8.8.8.8", True, True),  # an address on the Internet
    ],
)
def test_an_origin_cloudflare_cannot_reach_is_missing_on_a_real_account(origin, ok, blocking):
    from capabilities.runtimes.edge import origin_finding

    finding = origin_finding(origin, emulated=False)
    assert (finding.ok, finding.blocking) == (ok, blocking), finding.detail
    # The emulator's Workers reach this machine.
    assert origin_finding("http://127.0.0.1:8000", emulated=True).ok


def test_the_loader_check_removes_its_probe_worker(cf_settings, cf_emulator_fresh, redis_client):
    output, ok = cfcheck("loader")
    assert ok, output
    probe = f"/workers/scripts/{LOADER_PROBE_SCRIPT}"
    assert [call["status"] for call in cf_emulator_fresh.api_calls(method="PUT", path_suffix=probe)] == [200]
    assert [call["status"] for call in cf_emulator_fresh.api_calls(method="DELETE", path_suffix=probe)] == [200]
    # Checked twice: the probe left nothing behind, so the second upload creates it anew.
    assert cfcheck("loader")[1]


def test_a_token_cloudflare_does_not_know_stops_the_check(cf_settings, redis_client):
    cf_settings.CF_API_TOKEN = "not-the-token"
    output, ok = cfcheck("platform")
    assert not ok
    assert lines(output) == {"API token": "MISSING"}
    assert "CF_API_TOKEN" in output
    assert "not-the-token" not in output  # never echoed


def test_an_account_the_token_cannot_use(cf_settings, redis_client):
    cf_settings.CF_ACCOUNT_ID = "0" * 32
    output, ok = cfcheck("loader")
    assert not ok
    assert lines(output) == {"API token": "ok", "account": "MISSING"}
    assert "CF_ACCOUNT_ID" in output


def test_an_account_without_a_workers_dev_subdomain(cf_settings, cf_emulator_fresh, redis_client):
    cf_emulator_fresh.configure(subdomain="")
    output, ok = cfcheck("platform")
    assert not ok
    assert lines(output)["workers.dev subdomain"] == "MISSING"
    assert lines(output)["plan"] == "ok"


def test_a_full_script_quota_leaves_no_room_for_sigils_worker(cf_settings, cf_client, cf_emulator_fresh):
    cf_emulator_fresh.configure(script_limit=1)
    assert cfcheck("platform")[1]  # the account's one script can be the dispatch Worker
    source = {"owner.js": 'export default { fetch() { return new Response("mine") } }'}
    cf_client.script_upload(
        "owners-own-worker", modules=source, main_module="owner.js", compatibility_date="2025-01-01"
    )
    output, ok = cfcheck("platform")
    assert not ok
    assert lines(output)["scripts"] == "MISSING"
    assert "1 of the account's 1 Worker scripts (as Cloudflare's refusal named it)" in output


OWNERS = 'export default { fetch() { return new Response("mine") } }'


def test_a_free_account_says_how_many_slots_the_pool_can_really_use(cf_settings, cf_client, cf_emulator_fresh):
    # The settings' defaults are a paid account's: 500 scripts, 440 slots. Free allows 100.
    cf_emulator_fresh.configure(plan="free")
    for i in range(60):  # the owner's own Workers, more than the 50 reserved for them
        cf_client.script_upload(
            f"owners-{i}", modules={"o.js": OWNERS}, main_module="o.js", compatibility_date="2025-01-01"
        )
    output, ok = cfcheck("worker-pool")
    assert ok, output  # it works, paging out on Cloudflare's refusals
    assert (
        "60 of the account's 100 Worker scripts (the Workers Free plan's) are in use, 60 of them not Sigil's" in output
    )
    assert "Sigil can really use 30 slots, not the 440 its settings give" in output
    assert [line.split()[0] for line in output.splitlines() if "scripts:" in line] == ["note"]


def test_a_paid_account_with_room_gives_the_pool_every_slot_of_its_settings(cf_settings, cf_emulator_fresh):
    output, ok = cfcheck("worker-pool")
    assert ok, output
    assert "0 of the account's 500 Worker scripts (the Workers Paid plan's) are in use" in output
    assert "Sigil can use its 440 slots" in output


def test_a_pool_with_no_slot_left_on_the_account_cannot_work(cf_settings, cf_client, cf_emulator_fresh):
    cf_emulator_fresh.configure(plan="free", script_limit=12)  # 100 on Free; fewer to keep it short
    for i in range(12):
        cf_client.script_upload(
            f"owners-{i}", modules={"o.js": OWNERS}, main_module="o.js", compatibility_date="2025-01-01"
        )
    output, ok = cfcheck("worker-pool")
    assert not ok
    assert lines(output)["scripts"] == "MISSING"
    assert "Sigil can really use 0 slots" in output


def test_a_free_account_is_not_ready_for_the_loader_runtime(cf_settings, cf_emulator_fresh, redis_client):
    cf_emulator_fresh.configure(plan="free")
    output, ok = cfcheck("loader")
    assert not ok, output
    assert lines(output)["plan"] == "MISSING"
    assert "Workers Paid" in output
    assert cfcheck("worker-pool")[1]  # the pool needs nothing beyond the free plan


def test_an_account_without_workers_for_platforms_is_not_ready_for_the_platform_runtime(
    cf_settings, cf_emulator_fresh, redis_client
):
    cf_emulator_fresh.configure(workers_for_platforms=False)
    output, ok = cfcheck("platform")
    assert not ok, output
    assert lines(output)["plan"] == "MISSING"
    assert "Workers for Platforms" in output


@pytest.mark.parametrize("backend", ["platform", "loader"])
def test_an_account_without_an_origin_is_ready_but_told_that_call_records_cannot_arrive(
    backend, cf_settings, cf_emulator_fresh, redis_client, client
):
    cf_settings.SIGIL_ORIGIN_URL = ""
    cf_settings.SIGIL_EDGE = False  # the edge cannot be on without one (test_the_edge_needs_an_origin_url)
    cf_settings.SIGIL_BACKEND = backend
    output, ok = cfcheck(backend)
    assert ok, output  # Sigil serves: the records are what is missing
    [note] = [line for line in output.splitlines() if line.startswith("note")]
    assert "call records cannot arrive" in note and "SIGIL_ORIGIN_URL" in note
    warnings = client.get("/_health").json().get("warnings", [])
    assert any("call records cannot arrive" in warning and "SIGIL_ORIGIN_URL" in warning for warning in warnings)

    cf_settings.SIGIL_ORIGIN_URL = "https://sigil.example.com"
    assert "note" not in cfcheck(backend)[0]
    assert not any("call records" in warning for warning in client.get("/_health").json().get("warnings", []))


def test_json_gives_each_finding_and_still_exits_non_zero_when_not_ready(cf_settings, cf_emulator_fresh, redis_client):
    out = io.StringIO()
    call_command("cfcheck", backend="worker-pool", as_json=True, stdout=out)
    document = json.loads(out.getvalue())
    assert document["backend"] == "worker-pool" and document["ready"] is True
    assert {finding["topic"] for finding in document["findings"]} >= {"API token", "account", "scripts"}
    assert all(set(finding) == {"topic", "ok", "detail", "blocking"} for finding in document["findings"])

    cf_emulator_fresh.configure(subdomain="")
    out = io.StringIO()
    with pytest.raises(CommandError, match="cannot work on this account"):
        call_command("cfcheck", backend="platform", as_json=True, stdout=out)
    document = json.loads(out.getvalue())  # the JSON is whole though the command failed
    assert document["ready"] is False
    [missing] = [finding for finding in document["findings"] if not finding["ok"] and finding["blocking"]]
    assert missing["topic"] == "workers.dev subdomain"


def test_every_script_sigil_deployed_counts_as_sigils(platform, cf_settings, cf_client, db):
    """Sigil's own Workers of one runtime and then another (a switch leaves the first until it is
    deleted): the dispatch Worker, the Tail Worker, the edge Worker; only the owner's is not Sigil's."""
    from capabilities.runtimes import runtimes_forget

    call_command("deployruntime", stdout=io.StringIO())
    cf_settings.SIGIL_BACKEND, cf_settings.SIGIL_EDGE = "worker-pool", True
    runtimes_forget()
    call_command("deployruntime", stdout=io.StringIO())
    cf_client.script_upload(
        "owners-own-worker", modules={"o.js": OWNERS}, main_module="o.js", compatibility_date="2025-01-01"
    )
    scripts = {script.id for script in cf_client.script_list()}
    assert {"sigil-dispatcher", "sigil-tail", "sigil-edge", "owners-own-worker"} <= scripts

    out = io.StringIO()
    call_command("cfcheck", backend="worker-pool", as_json=True, stdout=out)
    [used] = [f["detail"] for f in json.loads(out.getvalue())["findings"] if f["topic"] == "scripts"]
    assert f"{len(scripts)} of the account's 500 Worker scripts" in used
    assert "are in use, 1 of them not Sigil's" in used
