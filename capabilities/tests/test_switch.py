"""Switching SIGIL_BACKEND with capabilities live: `manage.py switchbackend` moves them while
agents keep calling them over HTTP, against the Cloudflare emulator."""

import io
import json
import os
import re
import threading

import pytest
from django.core.management import CommandError, call_command

from agents.models import AuditEvent
from capabilities.models import Binding, Capability
from capabilities.runtimes import get_runtime, runtimes_forget
from capabilities.services import backend_switch
from testsupport.capability_code import answering as code
from testsupport.cast import grant, wait_for


class Callers:
    """Agents calling every capability in a loop, from two threads, until stopped."""

    def __init__(self, agent, names):
        self.agent, self.names = agent, names
        self.stop = threading.Event()
        self.calls, self.failures = 0, []
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(2)]

    def run(self):
        while not self.stop.is_set():
            for name in self.names:
                response = self.agent.call(f"/alice/{name}")
                self.calls += 1
                if (response.status_code, response.text) != (200, name):
                    self.failures.append((name, response.status_code, response.text[:200]))

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


@pytest.fixture(autouse=True)
def _owners_shell(monkeypatch):
    """The owner's shell, whose SIGIL_BACKEND `switch_to` sets as the restarted Sigil's: no
    runsigil runs here to record what it serves (sigil_site/tests/test_runsigil.py switches
    from a shell that does not set it)."""
    monkeypatch.setenv("SIGIL_BACKEND", "local")


def switch_to(settings, sigil, backend):
    """What the owner does before `switchbackend`: change SIGIL_BACKEND and restart Sigil."""
    settings.SIGIL_BACKEND = backend
    os.environ["SIGIL_BACKEND"] = backend  # restored by _owners_shell
    runtimes_forget()
    sigil.app.gateway = None


def pool_scripts(cf_client):
    return sorted(s.id for s in cf_client.script_list() if s.id.startswith("s-"))


@pytest.fixture
def on_the_pool(worker_pool, alice, settings, celery_worker):
    """Five capabilities on the worker pool (3 slots): three live, two paged out."""
    settings.SIGIL_SWITCH_GRACE_SECONDS = 0.3
    names = ["a", "b", "c", "d", "e"]
    for name in names:
        assert alice.deploy(name=name, code=code(name), type="normal").status_code == 201
    wait_for(lambda: Capability.objects.filter(state="paged_out").count() == 2, message="two page-outs")
    return names


def test_worker_pool_to_platform_with_capabilities_live_loses_none_and_leaves_no_pool_script(
    on_the_pool, alice, sigil, settings, cf_client, cf_emulator_fresh
):
    names = on_the_pool
    assert len(pool_scripts(cf_client)) == 3
    with Callers(alice, names) as callers:
        wait_for(lambda: callers.calls >= 10, message="calls before the switch")
        switch_to(settings, sigil, "platform")
        output = io.StringIO()
        call_command("switchbackend", stdout=output)
        before = callers.calls
        wait_for(lambda: callers.calls >= before + 10, message="calls after the switch")
    assert callers.failures == []

    out = output.getvalue()
    # The dispatch Worker is deployed once: by the switch, or first by a call that paged a
    # capability in on the new runtime meanwhile.
    assert len(cf_emulator_fresh.api_calls(method="PUT", path_suffix="/scripts/sigil-dispatcher")) == 1
    # Each of the five is moved or reassigned by the switch, or was paged in on the new
    # runtime by a call meanwhile (a paged-out capability has nothing to move).
    total = int(re.search(r"\[1/(\d+)\]", out).group(1))
    assert f"[{total}/{total}]" in out and "Switched to platform:" in out
    listed = set(re.findall(r"\] alice--(\w+):", out))
    assert len(listed) == total
    paged_in_meanwhile = AuditEvent.objects.filter(action="capability.paged_in").values_list("subject", flat=True)
    assert {f"alice--{name}" for name in set(names) - listed} <= set(paged_in_meanwhile)
    assert pool_scripts(cf_client) == []
    # The pool's edge Worker, if any, stays: the URLs it handed out keep working (through the origin).
    assert [s.id for s in cf_client.script_list() if s.id != settings.SIGIL_EDGE_WORKER] == ["sigil-dispatcher"]
    namespace = sorted(s.id for s in cf_client.namespace_script_list("sigil"))
    assert namespace == [f"alice--{name}" for name in names]
    assert set(Capability.objects.values_list("backend", "state")) == {("platform", "live")}
    switched = AuditEvent.objects.filter(action="capability.switched")
    assert {e.detail["from"] for e in switched} == {"worker-pool"} and switched.count() >= 3
    assert alice.call("/_api/status").json()["total_slots"] is None

    uploads = len(cf_emulator_fresh.api_calls(method="PUT"))
    again = io.StringIO()
    call_command("switchbackend", stdout=again)
    assert "nothing to move" in again.getvalue()
    assert len(cf_emulator_fresh.api_calls(method="PUT")) == uploads


def test_an_interrupted_switch_finishes_when_run_again(on_the_pool, alice, sigil, settings, cf_client):
    settings.SIGIL_SWITCH_GRACE_SECONDS = 60  # interrupted before any old placement is deleted
    switch_to(settings, sigil, "platform")
    events = backend_switch(source=None, actor="owner:test", grace_seconds=60)
    for event in events:
        if event.kind == "moved":
            break
    events.close()  # Ctrl-C
    moved = event.full
    assert Capability.objects.get(full_name=moved).backend == "platform"
    assert Capability.objects.filter(backend="worker-pool").count() == 4
    assert len(pool_scripts(cf_client)) == 3  # the moved one's old script too
    for name in on_the_pool:
        assert alice.call(f"/alice/{name}").text == name  # each served where it is recorded

    # Calls page paged-out capabilities in on the new runtime; the live ones are left to move.
    left = Capability.objects.filter(backend="worker-pool").count()
    settings.SIGIL_SWITCH_GRACE_SECONDS = 0
    output = io.StringIO()
    call_command("switchbackend", stdout=output)
    assert f"[{left}/{left}]" in output.getvalue() and f"Switched to platform: {left} moved." in output.getvalue()
    assert pool_scripts(cf_client) == []
    assert set(Capability.objects.values_list("backend", flat=True)) == {"platform"}
    assert AuditEvent.objects.filter(action="capability.switched").count() == 1 + left
    for name in on_the_pool:
        assert alice.call(f"/alice/{name}").text == name


def test_capabilities_placed_before_runtimes_were_recorded_need_from(on_the_pool, alice, sigil, settings, cf_client):
    Capability.objects.update(backend="")
    switch_to(settings, sigil, "platform")
    with pytest.raises(CommandError, match="--from"):
        call_command("switchbackend", stdout=io.StringIO())
    output = io.StringIO()
    call_command("switchbackend", "--from", "worker-pool", stdout=output)
    assert "5 capabilities placed before runtimes were recorded are on worker-pool" in output.getvalue()
    assert pool_scripts(cf_client) == []
    assert all(alice.call(f"/alice/{name}").text == name for name in on_the_pool)


def test_a_capability_the_new_runtime_cannot_give_its_bindings_stays_served_where_it_is(
    platform, alice, sigil, settings, cf_client
):
    namespace = cf_client.kv_namespace_create("capability-cache")["id"]
    grant(Binding.objects.create(kind="KV", name="CACHE", value=namespace), "alice")
    reads = "export default { async fetch(r, env) { return new Response(typeof env.CACHE) } }"
    alice.deploy(name="cached", code=reads, bindings=["KV:CACHE"])
    alice.deploy(name="plain", code=code("plain"))
    switch_to(settings, sigil, "loader")
    settings.SIGIL_SWITCH_GRACE_SECONDS = 0
    errors = io.StringIO()
    with pytest.raises(CommandError, match="1 could not be switched"):
        call_command("switchbackend", stdout=io.StringIO(), stderr=errors)
    assert "cannot provide KV" in errors.getvalue()
    assert Capability.objects.get(full_name="alice--cached").backend == "platform"
    assert alice.call("/alice/cached").text == "object"  # still in the namespace, served through the dispatcher
    assert Capability.objects.get(full_name="alice--plain").backend == "loader"
    assert alice.call("/alice/plain").text == "plain"
    assert sorted(s.id for s in cf_client.namespace_script_list("sigil")) == ["alice--cached"]
    assert get_runtime().name == "loader"


def test_a_dry_run_lists_what_would_move_and_changes_nothing(on_the_pool, alice, sigil, settings, cf_emulator_fresh):
    switch_to(settings, sigil, "platform")
    calls_before = len(cf_emulator_fresh.api_calls())
    output = io.StringIO()
    call_command("switchbackend", "--dry-run", "--json", stdout=output)
    plan = json.loads(output.getvalue())
    assert plan["to"] == "platform" and plan["unrecorded"] == 0
    assert sorted(item["capability"] for item in plan["moving"]) == [f"alice--{n}" for n in on_the_pool]
    assert {item["from"] for item in plan["moving"]} == {"worker-pool"}
    assert len(cf_emulator_fresh.api_calls()) == calls_before  # no runtime was called
    assert set(Capability.objects.values_list("backend", flat=True)) == {"worker-pool"}
    assert not AuditEvent.objects.filter(action="capability.switched").exists()
    text = io.StringIO()
    call_command("switchbackend", "--dry-run", stdout=text)
    assert "alice--a: worker-pool -> platform" in text.getvalue()
    assert "Would switch 5 capabilities to platform; nothing was changed." in text.getvalue()

    Capability.objects.update(backend="")
    with pytest.raises(CommandError, match="--from"):
        call_command("switchbackend", "--dry-run", stdout=io.StringIO())
    output = io.StringIO()
    call_command("switchbackend", "--dry-run", "--json", "--from", "worker-pool", stdout=output)
    assert json.loads(output.getvalue())["unrecorded"] == 5
    assert set(Capability.objects.values_list("backend", flat=True)) == {""}


def test_a_capability_never_placed_is_skipped_and_reported_and_needs_no_from(
    on_the_pool, alice, sigil, settings, cf_client
):
    # Its first deploy refused: recorded (failed), never on any runtime.
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 0
    assert alice.deploy(name="broken", code="export default {").status_code == 202
    wait_for(lambda: Capability.objects.get(full_name="alice--broken").state == "failed", message="the failure")
    switch_to(settings, sigil, "platform")

    plan = io.StringIO()
    call_command("switchbackend", "--dry-run", "--json", stdout=plan)
    plan = json.loads(plan.getvalue())
    assert (plan["unrecorded"], plan["skipped"]) == (0, ["alice--broken"])
    assert "alice--broken" not in {item["capability"] for item in plan["moving"]}

    output = io.StringIO()
    call_command("switchbackend", stdout=output)  # no --from
    out = output.getvalue()
    assert "alice--broken: never placed, nothing to move" in out and "1 skipped" in out
    assert "alice--broken:" not in out.split("never placed")[1]  # not moved as well
    broken = Capability.objects.get(full_name="alice--broken")
    assert (broken.backend, broken.slot, broken.state) == ("", "", "failed")
    assert not AuditEvent.objects.filter(action="capability.switched", subject="alice--broken").exists()
    assert all(alice.call(f"/alice/{name}").text == name for name in on_the_pool)
    assert sorted(s.id for s in cf_client.namespace_script_list("sigil")) == [f"alice--{n}" for n in on_the_pool]
