from django.core.checks import run_checks


def ids(errors) -> set[str]:
    return {error.id for error in errors}


def test_a_workerd_memory_limit_below_an_idle_workerd_is_refused_at_start(settings):
    settings.SIGIL_WORKERD_MEMORY_MB = 64
    assert "sigil.E011" in ids(run_checks())
    settings.SIGIL_WORKERD_MEMORY_MB = 512
    assert "sigil.E011" not in ids(run_checks())


def test_each_runtime_checks_its_own_settings(settings):
    settings.SIGIL_POOL_TOTAL_QUOTA = 10  # less than the 5 + 50 + 5 scripts set aside
    settings.SIGIL_BACKEND = "local"
    assert "sigil.E002" not in ids(run_checks())
    settings.SIGIL_BACKEND = "worker-pool"
    assert "sigil.E002" in ids(run_checks())


def test_prices_the_table_does_not_have_or_that_are_no_numbers_are_refused_at_start(settings):
    settings.SIGIL_CLOUDFLARE_PRICES = '{"paid_monthly_usd": 7.5}'
    assert "sigil.E005" not in ids(run_checks())
    for wrong in ('{"paid_monthly": 7.5}', '{"paid_monthly_usd": "7.5"}', "[7.5]", "not json"):
        settings.SIGIL_CLOUDFLARE_PRICES = wrong
        assert "sigil.E005" in ids(run_checks()), wrong


def test_the_edge_is_refused_at_start_without_a_runtime_on_cloudflare(settings):
    settings.SIGIL_EDGE = True
    settings.SIGIL_BACKEND = "local"
    assert "sigil.E006" in ids(run_checks())
    settings.SIGIL_BACKEND = "loader"
    assert "sigil.E006" not in ids(run_checks())
    settings.SIGIL_EDGE = False
    settings.SIGIL_BACKEND = "local"
    assert "sigil.E006" not in ids(run_checks())
