"""An incident walked through the owner's console in Chromium, against a live Sigil with real
workerd and a Celery worker: a capability starts throwing, the owner finds it from the
dashboard, reads why it fails, rolls it back and resets its breaker. Every page is saved
under test-artifacts/ in the light and dark themes, at 1400 and 390 px wide."""

import pytest

from capabilities import services
from capabilities.books import failures
from capabilities.models import Binding, BreakerState, Capability
from testsupport.browser import screenshot
from testsupport.capability_code import answering
from testsupport.cast import flush_stats_when_recorded, wait_for

THROWS = "export default { async fetch() { throw new Error('regressed again') } }"
WIDE, NARROW = 1400, 390


def shoot(page, name: str) -> None:
    """The page as it is, in both themes at both widths; leaves it light at 1400 px."""
    for width in (WIDE, NARROW):
        page.set_viewport_size({"width": width, "height": 900})
        for scheme in ("light", "dark"):
            page.emulate_media(color_scheme=scheme)
            screenshot(page, f"incident-{name}-{scheme}-{width}")
    page.set_viewport_size({"width": WIDE, "height": 900})
    page.emulate_media(color_scheme="light")


def scrolls_sideways(page) -> bool:
    return page.evaluate(
        "() => document.documentElement.scrollWidth > window.innerWidth"
        " || [...document.querySelectorAll('.results')].some(e => e.scrollWidth > e.clientWidth + 1)"
    )


def test_owner_finds_why_a_capability_fails_rolls_it_back_and_resets_it(sigil, owner, alice, settings, celery_worker):
    page = owner
    settings.SIGIL_BREAKER_THRESHOLD = 3
    assert alice.deploy(name="echo", code=answering("fine")).status_code == 201
    assert alice.deploy(name="echo", code=THROWS).status_code == 200
    answers = [alice.call("/alice/echo") for _ in range(3)]
    assert {a.status_code for a in answers} == {502}
    last_request_id = answers[-1].headers["X-Request-Id"]
    wait_for(lambda: alice.call("/alice/echo").status_code == 503, message="the breaker to open")
    wait_for(
        lambda: Capability.objects.get(full_name="alice--echo").breaker_state == BreakerState.OPEN,
        message="the breaker recorded open",
    )
    wait_for(lambda: len(failures.failures_list(full="alice--echo")) == 3, message="three failures recorded")
    flush_stats_when_recorded(alice__echo=3)
    capability = Capability.objects.get(full_name="alice--echo")

    # The index says at a glance that something is degraded.
    page.goto(f"{sigil.url}/admin/")
    page.locator("#index-degraded a", has_text="alice--echo").wait_for()
    shoot(page, "1-index")

    # The dashboard counts the refusals and lists the degraded capability.
    page.click(".sigil-pages >> text=Dashboard")
    page.locator("#kpi-calls .value", has_text="3").wait_for()
    assert int(page.locator("#kpi-refused .value").inner_text()) >= 1
    page.locator("#answers-by-code", has_text="degraded").wait_for()
    shoot(page, "2-dashboard")

    # Its page says why: the exception's message and the request id the caller got.
    page.click("#degraded-capabilities >> text=alice--echo")
    page.locator("h1", has_text="Capability alice--echo").wait_for()
    assert "Change capability" not in page.content()
    page.locator("#call-url", has_text=f"{sigil.url}/alice/echo").wait_for()
    page.locator("#breaker", has_text="the breaker tripped").wait_for()
    row = page.locator("#recent-failures tr.failure", has_text=last_request_id)
    row.get_by_text("Error: regressed again").wait_for()
    assert "v2" in row.inner_text() and "capability_error" in row.inner_text()
    assert page.locator("#recent-failures tr.tripped").count() == 3
    shoot(page, "3-capability-degraded")

    # Roll back, asked first.
    page.click("#rollback-v1")
    page.locator("#confirm-what", has_text="The code of v1 is deployed again").wait_for()
    shoot(page, "4-rollback-confirmation")
    page.click("#confirm")
    page.get_by_text("Rolled alice--echo back to the code of v1, now v3").wait_for()
    assert alice.call("/alice/echo").status_code == 503  # still degraded: the breaker decides

    # Reset the breaker; calls are served by the old code again.
    page.click("#action-reset-breaker")
    page.get_by_text("Reset the breaker of alice--echo").wait_for()
    page.locator("#breaker", has_text="Breaker closed").wait_for()
    shoot(page, "5-capability-recovered")
    served = alice.call("/alice/echo")
    assert served.status_code == 200 and served.text == "fine"

    # The admin's own history holds both actions, as the audit trail does.
    page.goto(f"{sigil.url}/admin/capabilities/capability/{capability.pk}/history/")
    page.get_by_text("Rolled back to v1").wait_for()
    page.get_by_text("Reset the breaker").wait_for()
    shoot(page, "6-history")
    page.goto(f"{sigil.url}/admin/")
    page.locator("#recent-actions-module", has_text="alice--echo").wait_for()


@pytest.mark.parametrize(
    "path",
    [
        "/admin/capabilities/capability/",
        "/admin/agents/agent/",
        "/admin/agents/token/",
        "/admin/agents/auditevent/",
        "/admin/capabilities/binding/",
    ],
)
def test_list_pages_fit_1400_px_without_a_horizontal_scroll(sigil, owner, alice, bob, path):
    page = owner
    services.binding_save(
        binding=Binding(kind="VAR", name="GREETING", value="hello", description="what capabilities say first"),
        secret_value="",
        actor="owner:root",
    )
    for name in ("a-rather-long-capability-name-for-width", "ping"):
        assert alice.deploy(name=name, code=answering("hi")).status_code == 201
        alice.call(f"/alice/{name}")
    page.set_viewport_size({"width": WIDE, "height": 900})
    page.goto(f"{sigil.url}{path}")
    page.locator("#result_list").wait_for()
    screenshot(page, f"list-{path.strip('/').replace('/', '-')}-{WIDE}")
    assert not scrolls_sideways(page)


def test_a_private_capability_shows_no_error_icon_and_view_site_opens_the_dashboard(sigil, owner, alice):
    page = owner
    assert alice.deploy(name="ping", code=answering("hi")).status_code == 201
    page.goto(f"{sigil.url}/admin/capabilities/capability/")
    cell = page.locator("#result_list td.field-visibility")
    assert cell.inner_text() == "private" and cell.locator("img").count() == 0
    page.click("text=View site")
    page.locator("#kpi-calls").wait_for()
    page.click("#nav-api-docs")
    page.wait_for_url(f"{sigil.url}/_api/schema/docs")


# WCAG contrast of each chart colour (its swatch) and of the quiet label text against the
# page's background, computed by the browser from the styles it applied.
CONTRASTS = """() => {
  const rgb = (text) => text.match(/[\\d.]+/g).slice(0, 3).map(Number);
  const linear = (v) => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
  const luminance = ([r, g, b]) => 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b);
  const ratio = (a, b) => {
    const [x, y] = [luminance(a), luminance(b)].sort((p, q) => q - p);
    return (x + 0.05) / (y + 0.05);
  };
  const background = rgb(getComputedStyle(document.body).backgroundColor);
  const found = {};
  for (const swatch of document.querySelectorAll('.swatch')) {
    found['swatch ' + swatch.className] = ratio(rgb(getComputedStyle(swatch).backgroundColor), background);
  }
  for (const label of document.querySelectorAll('.kpi .label')) {
    found['label'] = Math.min(found['label'] ?? 99, ratio(rgb(getComputedStyle(label).color), background));
  }
  for (const axis of document.querySelectorAll('.sigil-chart .axis')) {
    found['axis'] = Math.min(found['axis'] ?? 99, ratio(rgb(getComputedStyle(axis).fill), background));
  }
  return found;
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_dashboard_colours_keep_their_contrast_in_both_themes(sigil, owner, alice, scheme):
    page = owner
    assert alice.deploy(name="ping", code=answering("hi")).status_code == 201
    for _ in range(3):
        alice.call("/alice/ping")
    alice.call("/alice/nothing-here")
    flush_stats_when_recorded(alice__ping=3)
    page.emulate_media(color_scheme=scheme)
    page.goto(f"{sigil.url}/admin/dashboard/?refresh=off")
    page.locator("#kpi-calls .value", has_text="3").wait_for()
    contrasts = page.evaluate(CONTRASTS)
    assert any(name.startswith("swatch") for name in contrasts)
    # 3:1 for graphics and large text (WCAG 1.4.11), which chart marks and axis labels are.
    assert {name: round(value, 2) for name, value in contrasts.items() if value < 3} == {}
