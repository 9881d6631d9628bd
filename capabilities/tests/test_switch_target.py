"""Which runtime `switchbackend` moves capabilities to, run from a shell that may not set
SIGIL_BACKEND: the one the Sigil running on this var directory serves, as runsigil records
it, or a refusal naming the command to run. A real switch from a plain shell against a
running Sigil is in sigil_site/tests/test_runsigil.py."""

import io
import os

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command

from sigil.lifetime import PidFiles
from sigil.serving import RUNSIGIL, Serving, serving_forget, serving_now, serving_record

pytestmark = pytest.mark.django_db


@pytest.fixture
def plain_shell(monkeypatch):
    monkeypatch.delenv("SIGIL_BACKEND", raising=False)


@pytest.fixture
def running(plain_shell):
    """A Sigil on this var directory recorded as serving worker-pool on port 8400 (this
    process stands for its supervisor, whose pid file says it runs)."""
    pid_files = PidFiles(settings.VAR_DIR / "run")
    pid_files.record(RUNSIGIL, os.getpid())
    serving_record(settings.VAR_DIR, Serving(backend="worker-pool", port=8400, pid=os.getpid()))
    yield
    serving_forget(settings.VAR_DIR)
    pid_files.forget(RUNSIGIL)


def switchbackend(*args) -> str:
    out = io.StringIO()
    call_command("switchbackend", *args, stdout=out)
    return out.getvalue()


def test_a_plain_shell_with_no_sigil_running_is_told_what_to_pass(plain_shell):
    assert serving_now(settings.VAR_DIR) is None
    with pytest.raises(CommandError, match=r"SIGIL_BACKEND is not set in this shell") as refused:
        switchbackend()
    assert "`SIGIL_BACKEND=worker-pool python manage.py switchbackend`" in str(refused.value)
    with pytest.raises(CommandError, match=r"SIGIL_BACKEND is not set"):
        switchbackend("--dry-run")  # nothing is listed for a runtime it cannot tell either


def test_the_runtime_the_running_sigil_serves_is_the_target(running, settings):
    assert serving_now(settings.VAR_DIR) == Serving(backend="worker-pool", port=8400, pid=os.getpid())
    # Called from Python, this command cannot start again with that runtime's settings: it says how.
    with pytest.raises(CommandError, match=r"run `SIGIL_BACKEND=worker-pool python manage.py switchbackend`"):
        switchbackend("--dry-run")
    settings.SIGIL_BACKEND = "worker-pool"  # as the command started again has it
    assert "Would switch 0 capabilities to worker-pool" in switchbackend("--dry-run")


def test_a_shell_naming_another_runtime_than_sigil_serves_is_refused(running, monkeypatch):
    monkeypatch.setenv("SIGIL_BACKEND", "local")
    with pytest.raises(CommandError, match="serves worker-pool, but SIGIL_BACKEND is local here") as refused:
        switchbackend("--dry-run")
    assert "`SIGIL_BACKEND=worker-pool python manage.py switchbackend`" in str(refused.value)


def test_a_record_left_by_a_sigil_that_died_tells_nothing(plain_shell):
    serving_record(settings.VAR_DIR, Serving(backend="platform", port=8401, pid=os.getpid()))
    try:
        assert serving_now(settings.VAR_DIR) is None  # no runsigil pid file says it runs
    finally:
        serving_forget(settings.VAR_DIR)
