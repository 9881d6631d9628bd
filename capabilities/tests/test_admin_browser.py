"""The owner's console for capabilities, driven in Chromium against a live Sigil with real
workerd: degrade and reset, roll back, and the dashboard."""

from capabilities import tasks
from capabilities.models import Capability
from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.browser import DESKTOP, PHONE, screenshot
from testsupport.capability_code import answering as code
from testsupport.cast import flush_stats_when_recorded, wait_for


def run_action(page, base_url: str, capability: Capability, action: str) -> None:
    page.goto(f"{base_url}/admin/capabilities/capability/")
    page.check(f"input[name=_selected_action][value='{capability.pk}']")
    page.select_option("select[name=action]", action)
    page.click("button[name=index]")
    if page.locator("#confirm").count():  # a destructive action asks first
        page.click("#confirm")


def test_owner_forces_a_capability_degraded_and_resets_it(sigil, owner, alice):
    page = owner
    alice.deploy(name="ping", code=code("pong"))
    assert alice.call("/alice/ping").status_code == 200
    capability = Capability.objects.get(full_name="alice--ping")

    run_action(page, sigil.url, capability, "force_degraded")
    page.get_by_text("Forced 1 capability degraded").wait_for()
    refused = alice.call("/alice/ping")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "degraded"
    assert 1 <= int(refused.headers["Retry-After"]) <= 30  # one cool-down, not the forced epoch
    page.goto(f"{sigil.url}/admin/capabilities/capability/?health=degraded")
    page.locator("#result_list th.field-full_name", has_text="alice--ping").wait_for()
    screenshot(page, "capabilities-forced-degraded")

    run_action(page, sigil.url, capability, "reset_breakers")
    page.get_by_text("Reset the breaker of 1 capability").wait_for()
    served = alice.call("/alice/ping")
    assert served.status_code == 200 and served.text == "pong"
    assert Capability.objects.get(pk=capability.pk).breaker_state == "closed"


def test_owner_rolls_back_to_an_earlier_version_and_the_old_code_is_served(sigil, owner, alice):
    page = owner
    alice.deploy(name="greet", code=code("hello, one"))
    alice.deploy(name="greet", code=code("hello, two"))
    assert alice.call("/alice/greet").text == "hello, two"
    capability = Capability.objects.get(full_name="alice--greet")

    page.goto(f"{sigil.url}/admin/capabilities/capability/{capability.pk}/versions/2/")
    page.locator("#version-diff .del", has_text="hello, one").wait_for()
    page.locator("#version-diff .add", has_text="hello, two").wait_for()
    screenshot(page, "capabilities-version-diff")

    page.goto(f"{sigil.url}/admin/capabilities/capability/{capability.pk}/change/")
    page.click("#rollback-v1")
    page.locator("#confirm-what", has_text="The code of v1 is deployed again").wait_for()
    assert alice.call("/alice/greet").text == "hello, two"  # nothing changed before the confirmation
    page.click("#confirm")
    page.get_by_text("Rolled alice--greet back to the code of v1, now v3").wait_for()
    screenshot(page, "capabilities-rolled-back")
    assert alice.call("/alice/greet").text == "hello, one"
    capability.refresh_from_db()
    assert capability.current_version.number == 3
    assert capability.current_version.sha == capability.versions.get(number=1).sha


def test_dashboard_shows_the_calls_just_made(sigil, owner, alice, celery_worker):
    page = owner
    alice.deploy(name="busy", code=code("busy"))
    alice.deploy(name="quiet", code=code("quiet"))
    for _ in range(7):
        assert alice.call("/alice/busy").status_code == 200
    assert alice.call("/alice/quiet").status_code == 200
    flush_stats_when_recorded(alice__busy=7, alice__quiet=1)

    page.goto(f"{sigil.url}/admin/")
    page.click(".sigil-pages >> text=Dashboard")
    page.locator("#kpi-calls .value", has_text="8").wait_for()
    rows = page.locator("#top-capabilities tbody tr")
    assert rows.nth(0).inner_text().split()[:2] == ["alice--busy", "7"]
    assert rows.nth(1).inner_text().split()[:2] == ["alice--quiet", "1"]
    assert page.locator("figure.sigil-chart svg rect.bar.calls").count() >= 1
    screenshot(page, "dashboard")

    # The flush that beat sends, run by a worker, appears on the schedule page.
    tasks.capability_flush_stats.delay()
    wait_for(
        lambda: get_redis().hexists(redis_keys.BEAT_LAST_RUN, "capabilities.capability_flush_stats"), message="a flush"
    )
    page.click("nav.sigil-nav >> text=Beat schedule")
    row = page.locator("#beat-schedule tr", has_text="capability-flush-stats")
    row.get_by_text("succeeded").wait_for()
    screenshot(page, "beat-schedule")


FAILING = """export default { async fetch() {
  return new Response("the upstream database refused the connection: too many clients already", { status: 500 });
} }"""


def test_a_capability_page_shows_its_failures_readably_on_a_phone(sigil, owner, alice):
    page = owner
    alice.deploy(name="flaky", code=FAILING, type="normal")
    for _ in range(3):
        assert alice.call("/alice/flaky").status_code == 500
    capability = Capability.objects.get(full_name="alice--flaky")
    page.goto(f"{sigil.url}/admin/capabilities/capability/{capability.pk}/change/")
    page.locator("#recent-failures tr.failure").first.wait_for()
    screenshot(page, "capability-page-failures")
    page.set_viewport_size(PHONE)
    try:
        # The message wraps at words in a column of its own, not a character per line.
        width = page.locator("#recent-failures td.message").first.evaluate("cell => cell.getBoundingClientRect().width")
        assert width >= 150
    finally:
        page.set_viewport_size(DESKTOP)


# The width the owner's list pages must fit whole, beside the filters (a laptop's browser).
LAPTOP = {"width": 1400, "height": 900}
# What of the capabilities list is hidden to the right of its box, which scrolls sideways:
# the box's widths and where the table's last heading ends against the box's right edge.
CUT = """() => {
  const box = document.querySelector("#changelist .results");
  const last = [...document.querySelectorAll("#result_list thead th")].pop();
  return { scroll: box.scrollWidth, client: box.clientWidth,
           cut: Math.round(last.getBoundingClientRect().right - box.getBoundingClientRect().right) };
}"""


def test_the_capabilities_list_fits_a_laptop_whole(sigil, owner, alice):
    page = owner
    for name in ("a-rather-long-capability-name-for-a-list", "ping", "flaky"):
        alice.deploy(name=name, code=code("ok"), description="what it does, at some length " * 3)
        assert alice.call(f"/alice/{name}").status_code == 200
    flush_stats_when_recorded(alice__ping=1)  # a last call's date and time, the widest cell
    capability = Capability.objects.get(full_name="alice--flaky")
    run_action(page, sigil.url, capability, "force_degraded")  # the widest health cell
    page.get_by_text("Forced 1 capability degraded").wait_for()
    page.set_viewport_size(LAPTOP)
    try:
        page.goto(f"{sigil.url}/admin/capabilities/capability/")
        measured = page.evaluate(CUT)
        assert measured["cut"] <= 0 and measured["scroll"] <= measured["client"], measured
        screenshot(page, "capabilities-list-1400")  # and at 390 px the page itself is no wider
    finally:
        page.set_viewport_size(DESKTOP)
