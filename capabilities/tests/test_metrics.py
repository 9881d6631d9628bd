"""GET /metrics: valid Prometheus text whose counters match the calls made."""

import requests
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from testsupport.cast import flush_stats_when_recorded


def scrape(sigil, token="scrape-me"):
    return requests.get(f"{sigil.url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)


def samples(text):
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_metrics_parse_and_count_the_calls_made(sigil, alice, settings):
    settings.SIGIL_METRICS_TOKEN = "scrape-me"
    alice.deploy(name="ok", code="export default { async fetch() { return new Response('ok') } }")
    alice.deploy(name="bad", code="export default { async fetch() { return new Response('no', { status: 503 }) } }")
    for _ in range(5):
        alice.call("/alice/ok")
    for _ in range(2):
        alice.call("/alice/bad")
    flush_stats_when_recorded(alice__ok=5, alice__bad=2)

    response = scrape(sigil)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
    found = samples(response.text)
    ok = (("agent", "alice"), ("capability", "alice--ok"))
    bad = (("agent", "alice"), ("capability", "alice--bad"))
    assert found[("sigil_capability_calls_total", ok)] == 5
    assert found[("sigil_capability_errors_total", ok)] == 0
    assert found[("sigil_capability_calls_total", bad)] == 2
    assert found[("sigil_capability_errors_total", bad)] == 2
    assert found[("sigil_capability_latency_seconds_count", ok)] == 5
    assert found[("sigil_capability_latency_seconds_bucket", (*ok, ("le", "+Inf")))] == 5
    assert 0 < found[("sigil_capability_latency_seconds_sum", ok)] < 5 * 10  # seconds, not milliseconds
    assert found[("sigil_slots_used", ())] == 2
    assert found[("sigil_agents", ())] == 1


def test_metrics_need_the_configured_token(sigil, settings):
    settings.SIGIL_METRICS_TOKEN = "scrape-me"
    assert scrape(sigil, token="wrong").status_code == 401
    assert requests.get(f"{sigil.url}/metrics", timeout=10).status_code == 401


def test_metrics_are_off_without_a_token(sigil, settings):
    settings.SIGIL_METRICS_TOKEN = ""
    response = scrape(sigil)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_metrics_count_cloudflare_api_calls_and_429s(sigil, worker_pool, alice, settings):
    settings.SIGIL_METRICS_TOKEN = "scrape-me"
    worker_pool.configure(fail_next=0)
    alice.deploy(name="a", code="export default { async fetch() { return new Response('a') } }")
    found = samples(scrape(sigil).text)
    made = len(worker_pool.api_calls())
    assert made >= 2  # the upload and the workers.dev toggle
    assert found[("sigil_cloudflare_api_calls_total", ())] == made
    assert found[("sigil_cloudflare_rate_limited_total", ())] == 0
    assert found[("sigil_slots_capacity", ())] == 3
    # What spent them: the deploy's task, an upload and the workers.dev toggle.
    by_class = {labels[0][1]: value for (name, labels), value in found.items() if name.endswith("by_class_total")}
    assert by_class == {"page-in": 0, "deploy": made, "page-out": 0, "housekeeping": 0}
    by_operation = {
        labels[0][1]: value for (name, labels), value in found.items() if name.endswith("by_operation_total")
    }
    assert by_operation["upload"] == 1 and by_operation["subdomain-toggle"] == 1
    assert sum(by_operation.values()) == made


def test_metrics_count_refusals_by_class_and_code_and_gauge_degraded_capabilities(sigil, alice, settings):
    from capabilities.models import Capability
    from capabilities.services import capability_force_degraded

    settings.SIGIL_METRICS_TOKEN = "scrape-me"
    alice.deploy(name="ok", code="export default { async fetch() { return new Response('ok') } }")
    assert alice.call("/alice/ok").status_code == 200
    capability_force_degraded(capability=Capability.objects.get(full_name="alice--ok"), actor="owner:root")
    for _ in range(2):
        assert alice.call("/alice/ok").status_code == 503
    assert alice.call("/alice/missing").status_code == 404
    flush_stats_when_recorded(alice__ok=1)

    found = samples(scrape(sigil).text)
    ok = (("agent", "alice"), ("capability", "alice--ok"))
    assert found[("sigil_capability_calls_total", ok)] == 1
    assert found[("sigil_capability_refused_total", ok)] == 2
    assert found[("sigil_capability_answers_total", (*ok, ("class", "2xx")))] == 1
    assert found[("sigil_capability_answers_total", (*ok, ("class", "5xx")))] == 2
    assert found[("sigil_answers_total", (("class", "4xx"),))] == 1  # the 404 named no capability
    assert found[("sigil_answer_errors_total", (("code", "degraded"),))] == 2
    assert found[("sigil_answer_errors_total", (("code", "not_found"),))] == 1
    assert found[("sigil_capabilities_degraded", ())] == 1


def test_wrong_metrics_tokens_are_braked_like_agents_tokens(sigil, alice, settings):
    settings.SIGIL_METRICS_TOKEN = "scrape-me"
    settings.SIGIL_AUTH_FAILURE_LIMIT = 3
    # One count per address, whichever door the guesses knock on.
    assert alice.call("/alice/anything", token=None, headers={"Authorization": "Bearer sgl_guess"}).status_code == 401
    for _ in range(2):
        assert scrape(sigil, token="guess").status_code == 401
    refused = scrape(sigil, token="guess")  # over the limit: braked until the window ends
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
    assert int(refused.headers["Retry-After"]) >= 1
    assert scrape(sigil).status_code == 200  # the right token is still served


def test_metrics_and_llms_txt_answer_other_methods_in_the_envelope(sigil, settings):
    settings.SIGIL_METRICS_TOKEN = "scrape-me"
    for method, path in [("POST", "/metrics"), ("DELETE", "/metrics"), ("PUT", "/llms.txt"), ("POST", "/llms.txt")]:
        # No CSRF cookie or token: Django's CSRF refusal used to answer with its HTML page.
        response = requests.request(method, f"{sigil.url}{path}", data=b"x", timeout=10)
        assert response.status_code == 405, (method, path, response.text[:200])
        assert response.json()["error"]["code"] == "invalid_request"
        assert response.headers["Allow"] == "GET, HEAD"


def test_metrics_follow_prometheus_conventions_and_say_how_far_behind_they_are(sigil, alice, settings):
    settings.SIGIL_METRICS_TOKEN = "scrape-me"
    settings.SIGIL_STATS_FLUSH_INTERVAL_SECONDS = 10
    alice.deploy(name="ok", code="export default { async fetch() { return new Response('ok') } }")
    assert alice.call("/alice/ok").status_code == 200
    flush_stats_when_recorded(alice__ok=1)
    families = {family.name: family for family in text_string_to_metric_families(scrape(sigil).text)}

    for family in families.values():
        assert "_ms" not in family.name and "milli" not in family.name, family.name  # base units: seconds
        for sample in family.samples:
            # `_total` on every counter's samples, and on no other metric's.
            assert sample.name.endswith("_total") == (family.type == "counter"), (family.type, sample.name)
    assert families["sigil_capability_latency_seconds"].type == "histogram"
    bounds = [s.labels["le"] for s in families["sigil_capability_latency_seconds"].samples if "le" in s.labels]
    assert bounds[:3] == ["0.001", "0.0025", "0.005"] and bounds[-1] == "+Inf"
    assert families["sigil_capability_page_in_seconds"].type == "counter"
    # What the stats flush feeds says it lags behind the calls, and by how much.
    for name in ("sigil_capability_calls", "sigil_capability_latency_seconds", "sigil_answers"):
        assert "up to 10 s behind the calls" in families[name].documentation, name
    assert "behind" not in families["sigil_agents"].documentation

    # A scraper that asks for OpenMetrics gets it, from the same collector.
    openmetrics = requests.get(
        f"{sigil.url}/metrics",
        headers={"Authorization": "Bearer scrape-me", "Accept": "application/openmetrics-text; version=1.0.0"},
        timeout=10,
    )
    assert openmetrics.headers["Content-Type"].startswith("application/openmetrics-text")
    parsed = {f.name: f for f in openmetrics_families(openmetrics.text)}
    ok = {"agent": "alice", "capability": "alice--ok"}
    [calls] = [s for s in parsed["sigil_capability_calls"].samples if s.labels == ok]
    assert calls.value == 1
