"""The system check that guards the abuse settings."""

import pytest
from django.core.checks import run_checks


def sigil_errors() -> set[str]:
    return {message.id for message in run_checks() if (message.id or "").startswith("sigil.E03")}


def test_the_defaults_pass():
    assert sigil_errors() == set()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"SIGIL_AUTH_FAILURE_WINDOW_SECONDS": 0}, "sigil.E030"),
        ({"SIGIL_AUTH_FAILURE_LIMIT": -1}, "sigil.E030"),
        ({"SIGIL_ADMIN_LOCKOUT_SECONDS": 0}, "sigil.E031"),
        ({"SIGIL_TRUSTED_PROXY_COUNT": -1}, "sigil.E032"),
        ({"SIGIL_JSON_MAX_DEPTH": 0}, "sigil.E033"),
        ({"SIGIL_JSON_MAX_DEPTH": 5000}, "sigil.E033"),
    ],
)
def test_a_setting_out_of_range_is_named(settings, overrides, expected):
    for name, value in overrides.items():
        setattr(settings, name, value)
    assert sigil_errors() == {expected}


def test_a_window_does_not_matter_while_the_throttle_is_off(settings):
    settings.SIGIL_AUTH_FAILURE_LIMIT = 0
    settings.SIGIL_AUTH_FAILURE_WINDOW_SECONDS = 0
    assert sigil_errors() == set()
