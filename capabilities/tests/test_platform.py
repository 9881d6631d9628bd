"""The platform runtime end to end: Sigil's REST API and gateway over HTTP, the emulator's
dispatch namespace behind the repo's dispatch Worker."""

from django.core.management import call_command

from capabilities.runtimes import get_runtime

PONG = "export default { async fetch() { return new Response('pong') } }"


def test_deployruntime_deploys_the_dispatch_worker_once_and_checks_it(platform, db, capsys):
    call_command("deployruntime")
    first = capsys.readouterr().out
    assert "created the dispatch namespace sigil" in first and "deployed the dispatch Worker sigil-dispatcher" in first
    call_command("deployruntime")
    assert capsys.readouterr().out.strip() == "platform: up to date"
    get_runtime().check()


def test_status_has_no_slot_limit_and_no_pager(platform, alice):
    alice.deploy(name="ping", code=PONG)
    status = alice.call("/_api/status").json()
    assert status == {**status, "backend": "platform", "total_slots": None, "lru_enabled": False}
