"""Debian's Chromium driven by Playwright, for the admin's browser tests.

Playwright's synchronous API runs an asyncio event loop in the thread that starts it, and
Django refuses database calls from a thread with a running loop. So the browser lives in a
thread of its own, and tests hold `Remote` proxies: every attribute read and method call
on a page or a locator runs in that thread, while the test's thread stays free for the ORM
(and Django's async-safety check stays on for the whole suite).
"""

from __future__ import annotations

import concurrent.futures
import queue
import re
import threading
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
MISSING = f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium), or install it by hand"


class BrowserThread:
    """One Chromium for the test session, owned by one thread that runs every call to it."""

    def __init__(self) -> None:
        if not CHROMIUM.exists():
            raise RuntimeError(MISSING)
        self._calls: queue.Queue = queue.Queue()
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(started,), name="chromium", daemon=True)
        self._thread.start()
        self.browser = Remote(self, started.result(timeout=60))

    def _serve(self, started: concurrent.futures.Future) -> None:
        from playwright.sync_api import sync_playwright

        try:
            playwright = sync_playwright().start()
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(browser)
        while (item := self._calls.get()) is not None:
            function, future = item
            try:
                future.set_result(function())
            except BaseException as exc:
                future.set_exception(exc)
        browser.close()
        playwright.stop()

    def run(self, function):
        """Run `function()` in the browser's thread and return (or raise) what it did."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((function, future))
        return future.result()

    def stop(self) -> None:
        self._calls.put(None)
        self._thread.join(timeout=30)


class Remote:
    """A Playwright object used from another thread: reads and calls run in the browser's."""

    __slots__ = ("_owner", "_target")

    def __init__(self, owner: BrowserThread, target) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str):
        value = self._owner.run(lambda: getattr(self._target, name))
        if callable(value):

            def call(*args, **kwargs):
                args = [_unwrap(a) for a in args]
                kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
                return _wrap(self._owner, self._owner.run(lambda: value(*args, **kwargs)))

            return call
        return _wrap(self._owner, value)

    def expect(self):
        """Playwright's `expect()` on this page or locator, e.g. `page.get_by_text("x").expect().to_be_visible()`."""
        from playwright.sync_api import expect

        return Remote(self._owner, self._owner.run(lambda: expect(self._target)))


def _unwrap(value):
    return value._target if isinstance(value, Remote) else value


def _wrap(owner: BrowserThread, value):
    if isinstance(value, list):
        return [_wrap(owner, v) for v in value]
    if type(value).__module__.startswith("playwright."):
        return Remote(owner, value)
    return value


# The widths the owner's pages are checked at: a desktop, and a phone (an iPhone 12 to 15).
DESKTOP = {"width": 1440, "height": 900}
PHONE = {"width": 390, "height": 844}
# What sticks out past the right edge of the viewport, widest first: the page's own width,
# and a few elements that make it (tag, id or class, and their width) for the message.
OVERFLOW = """() => {
  const width = document.documentElement.clientWidth;
  const culprits = [];
  for (const element of document.body.querySelectorAll("*")) {
    const box = element.getBoundingClientRect();
    if (box.right > width + 1 && box.width > 0 && getComputedStyle(element).position !== "fixed") {
      let scrolled = false;
      for (let up = element.parentElement; up && up !== document.body; up = up.parentElement) {
        const overflow = getComputedStyle(up).overflowX;
        if (overflow === "auto" || overflow === "scroll" || overflow === "hidden") { scrolled = true; break; }
      }
      if (!scrolled) {
        const classes = typeof element.className === "string" ? element.className.trim() : "";
        const name = element.tagName.toLowerCase() + (element.id ? "#" + element.id : "")
          + (classes ? "." + classes.split(/\\s+/).join(".") : "");
        culprits.push([Math.round(box.right), name]);
      }
    }
  }
  culprits.sort((a, b) => b[0] - a[0]);
  return { page: document.documentElement.scrollWidth, viewport: width, culprits: culprits.slice(0, 6) };
}"""


def screenshot(page: Remote, name: str, *, phone: bool = True) -> Path:
    """Save the whole page under test-artifacts/ (kept for a person to look at) and return the
    path; with `phone`, also at 390 px (`<name>-phone.png`), where the page body must not be
    wider than the screen (AssertionError naming what sticks out)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}.png"
    page.screenshot(path=str(path), full_page=True)
    if phone:
        page.set_viewport_size(PHONE)
        try:
            measured = page.evaluate(OVERFLOW)
            page.screenshot(path=str(path.with_name(f"{path.stem}-phone.png")), full_page=True)
        finally:
            page.set_viewport_size(DESKTOP)
        assert measured["page"] <= measured["viewport"], (
            f"{name}: at {PHONE['width']} px the page is {measured['page']} px wide; "
            f"what sticks out (right edge, element): {measured['culprits']}"
        )
    return path


def log_in(page: Remote, base_url: str, *, username: str, password: str) -> None:
    """Sign in to the admin through its login form."""
    page.goto(f"{base_url}/admin/login/?next=/admin/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base_url}/admin/")


def watch_console(page: Remote) -> list[str]:
    """Collect the page's console errors (a script error, a Content-Security-Policy
    violation, a failed load) and uncaught exceptions, from now on, into the list returned."""
    errors: list[str] = []

    def on_console(message) -> None:
        if message.type == "error":
            errors.append(f"{message.text} ({message.location.get('url', '')})")

    page.on("console", on_console)
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    return errors
