"""`manage.py deployruntime` on each runtime with an account Worker of its own (the loader's
host, the platform's dispatcher): the first run creates and deploys, the next finds it all up
to date, and the runtime's start check then passes."""

import json

import pytest
from django.core.management import call_command

from capabilities.runtimes import get_runtime


@pytest.fixture
def backend(request):
    """Sigil on the runtime `request.param` names (the conftest fixture of that name)."""
    request.getfixturevalue(request.param)
    return request.param


@pytest.mark.parametrize(
    ("backend", "created", "deployed"),
    [
        ("loader", "created the KV namespace sigil-code", "deployed the loader Worker sigil-loader"),
        ("platform", "created the dispatch namespace sigil", "deployed the dispatch Worker sigil-dispatcher"),
    ],
    indirect=["backend"],
)
def test_deployruntime_deploys_the_runtimes_worker_once_and_checks_it(backend, created, deployed, db, capsys):
    call_command("deployruntime")
    first = capsys.readouterr().out
    assert created in first and deployed in first
    call_command("deployruntime")
    assert capsys.readouterr().out.strip() == f"{backend}: up to date"
    get_runtime().check()


def test_deployruntime_json_says_what_it_did(platform, db, capsys):
    call_command("deployruntime", as_json=True)
    first = json.loads(capsys.readouterr().out)
    assert first["backend"] == "platform" and first["state"] == "ready"
    assert any(line.startswith("deployed the dispatch Worker sigil-dispatcher") for line in first["done"])
    call_command("deployruntime", as_json=True)
    assert json.loads(capsys.readouterr().out) == {"backend": "platform", "done": [], "state": "up to date"}
