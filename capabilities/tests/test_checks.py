from django.core.checks import run_checks


def ids(errors) -> set[str]:
    return {error.id for error in errors}


def test_a_workerd_memory_limit_below_an_idle_workerd_is_refused_at_start(settings):
    settings.SIGIL_WORKERD_MEMORY_MB = 64
    assert "sigil.E011" in ids(run_checks())
    settings.SIGIL_WORKERD_MEMORY_MB = 512
    assert "sigil.E011" not in ids(run_checks())
