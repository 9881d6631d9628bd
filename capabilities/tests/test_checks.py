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


def test_the_edge_on_a_cloudflare_runtime_needs_an_origin_to_send_what_it_cannot_serve(settings):
    settings.SIGIL_BACKEND = "platform"
    settings.SIGIL_EDGE = True
    settings.SIGIL_ORIGIN_URL = ""
    assert "sigil.E040" in ids(run_checks())
    for wrong in ("sigil.example.com", "ftp://sigil.example.com", "https://sigil.example.com/sigil/"):
        settings.SIGIL_ORIGIN_URL = wrong
        assert "sigil.E041" in ids(run_checks()), wrong
    settings.SIGIL_ORIGIN_URL = "https://sigil.example.com/"
    settings.SIGIL_EDGE_URL = "edge.example.com"
    assert {"sigil.E040", "sigil.E041"} & ids(run_checks()) == set()
    assert "sigil.E042" in ids(run_checks())
    settings.SIGIL_EDGE_URL = "https://edge.example.com"
    assert not {"sigil.E040", "sigil.E041", "sigil.E042"} & ids(run_checks())
    # Off, or on the local runtime, the edge needs nothing.
    settings.SIGIL_ORIGIN_URL = ""
    settings.SIGIL_EDGE = False
    assert "sigil.E040" not in ids(run_checks())
    settings.SIGIL_EDGE, settings.SIGIL_BACKEND = True, "local"
    assert "sigil.E040" not in ids(run_checks())


def test_the_edge_is_refused_at_start_without_a_runtime_on_cloudflare(settings):
    settings.SIGIL_EDGE = True
    settings.SIGIL_BACKEND = "local"
    assert "sigil.E043" in ids(run_checks())
    settings.SIGIL_BACKEND = "loader"
    assert "sigil.E043" not in ids(run_checks())
    settings.SIGIL_EDGE = False
    settings.SIGIL_BACKEND = "local"
    assert "sigil.E043" not in ids(run_checks())
