"""A brake on guessing: failed tokens are throttled per client address on the API and the
gateway, and the admin's login locks an address out, both shared by every process through
Redis."""

from __future__ import annotations

import re

import pytest
import requests

from sigil import redis_keys
from sigil.ports import free_port
from testsupport.capability_code import PONG
from testsupport.cast import wait_for
from testsupport.servers import served

BAD = {"Authorization": "Bearer sgl_not-a-token"}


def assert_throttled(response) -> None:
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "rate_limited"
    assert int(response.headers["Retry-After"]) >= 1


@pytest.fixture
def ping(alice):
    assert alice.deploy(name="ping", code=PONG).status_code == 201


def test_failed_tokens_are_throttled_on_the_gateway_and_the_api_alike(alice, ping, settings):
    settings.SIGIL_AUTH_FAILURE_LIMIT = 4
    settings.SIGIL_AUTH_FAILURE_WINDOW_SECONDS = 2
    for _ in range(2):
        assert alice.call("/alice/ping", token=None, headers=BAD).status_code == 401
        assert requests.get(f"{alice.base_url}/_api/capabilities", headers=BAD, timeout=10).status_code == 401
    # The limit is reached: this address's failing tokens are refused; a token that
    # authenticates is still served (agents share addresses: the brake stops only guesses).
    assert_throttled(alice.call("/alice/ping", token=None, headers=BAD))
    assert_throttled(requests.get(f"{alice.base_url}/_api/capabilities", headers=BAD, timeout=10))
    assert alice.call("/alice/ping").status_code == 200
    assert requests.get(f"{alice.base_url}/_api/capabilities", headers=alice.headers(alice.invoke_token)).ok
    # Until the window ends.
    wait_for(
        lambda: alice.call("/alice/ping", token=None, headers=BAD).status_code == 401,
        timeout=10,
        message="the window to end",
    )


def test_calls_without_a_token_and_valid_calls_are_not_counted(alice, ping, settings):
    settings.SIGIL_AUTH_FAILURE_LIMIT = 2
    for _ in range(5):
        assert alice.call("/alice/ping", token=None).status_code == 401
        assert alice.call("/alice/ping").status_code == 200


def test_addresses_behind_a_trusted_proxy_are_counted_apart(alice, ping, settings):
    settings.SIGIL_AUTH_FAILURE_LIMIT = 2
    settings.SIGIL_TRUSTED_PROXY_COUNT = 1
    guesser = {"X-Forwarded-For": "203.0.113.9, 198.51.100.7"}  # the proxy appended the last
    for _ in range(2):
        assert alice.call("/alice/ping", token=None, headers={**BAD, **guesser}).status_code == 401
    assert_throttled(alice.call("/alice/ping", token=None, headers={**BAD, **guesser}))
    # Another caller behind the same proxy, whatever it claims further left, is not held back.
    other = {"X-Forwarded-For": "198.51.100.7, 192.0.2.1"}
    assert alice.call("/alice/ping", token=None, headers={**BAD, **other}).status_code == 401


# What a call's commands name: the capability, the token or the throttle's count.
CALL_KEYS = ("alice--ping", redis_keys.token(""), redis_keys.auth_failures(""))
SINK_ROUTE_READ = f"GET {redis_keys.route('alice--ping')}"  # call_logs._version_of
LOG_KEYS = redis_keys.logs("")  # the prefix of every key of call records


def test_a_valid_warm_call_makes_no_more_redis_round_trips(alice, ping, redis_client):
    """One MGET before the call and one script call after it, as before the throttle."""
    import threading

    def recorded(calls: int) -> bool:
        return int(redis_client.hget(redis_keys.stats("alice--ping"), "calls") or 0) == calls

    assert alice.call("/alice/ping").status_code == 200  # fills the caches
    wait_for(lambda: recorded(1), message="the first call to be recorded")
    seen, ready, done = [], threading.Event(), threading.Event()

    # MONITOR shows every database of the server: on a Redis shared by the suite's workers
    # (each on a database of its own), the other workers' calls of their own alice--ping too.
    own_db = redis_client.connection_pool.connection_kwargs.get("db", 0)

    def watch() -> None:
        with redis_client.monitor() as monitor:
            ready.set()
            for command in monitor.listen():
                if command.get("db", own_db) != own_db:
                    continue
                text = command["command"]
                if text.startswith("HGET") and "calls" in text:
                    if done.is_set():
                        return
                    continue  # the test's own polling
                # Commands a script runs are no round trips; a Celery worker of the session
                # may be polling its queue meanwhile, and the log sink storing a call's record
                # (LOG_KEYS, and the route it reads the version from) is workerd's tail
                # delivering it, not the call: the call reads the route in its MGET.
                if command["client_type"] == "lua" or LOG_KEYS in text or text == SINK_ROUTE_READ:
                    continue
                if any(mark in text for mark in CALL_KEYS):
                    seen.append(text.split()[0].upper())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ready.wait(10)
    assert alice.call("/alice/ping").status_code == 200
    wait_for(lambda: recorded(2), message="the second call to be recorded")
    done.set()
    redis_client.hget(redis_keys.stats("alice--ping"), "calls")
    watcher.join(10)
    assert seen == ["MGET", "EVALSHA"]


def admin_login(session: requests.Session, base_url: str, password: str, username: str = "owner") -> requests.Response:
    form = session.get(f"{base_url}/admin/login/", timeout=30)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    return session.post(
        f"{base_url}/admin/login/?next=/admin/",
        data={"csrfmiddlewaretoken": token, "username": username, "password": password, "next": "/admin/"},
        allow_redirects=False,
        timeout=30,
    )


@pytest.fixture
def owner_account(transactional_db):
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_superuser("owner", "owner@example.invalid", "the-right-password")


@pytest.mark.slow
def test_lockout_and_throttling_hold_across_two_processes(alice, ping, owner_account, tmp_path):
    environment = {
        "SIGIL_AUTH_FAILURE_LIMIT": "4",
        "SIGIL_AUTH_FAILURE_WINDOW_SECONDS": "60",
        "SIGIL_ADMIN_LOGIN_FAILURE_LIMIT": "3",
        "SIGIL_ADMIN_LOCKOUT_SECONDS": "60",
    }
    with (
        served("granian", port=free_port(), environment=environment, log=tmp_path / "granian.log") as first,
        served("uvicorn", port=free_port(), environment=environment, log=tmp_path / "uvicorn.log") as second,
    ):
        # Bad tokens, half to each process: the count is one.
        for url in (first, second, first, second):
            assert requests.get(f"{url}/alice/ping", headers=BAD, timeout=10).status_code == 401
        for url in (first, second):
            assert_throttled(requests.get(f"{url}/alice/ping", headers=BAD, timeout=10))
            assert_throttled(requests.get(f"{url}/_api/status", headers=BAD, timeout=10))
            assert requests.get(f"{url}/alice/ping", headers=alice.headers(alice.invoke_token), timeout=10).ok

        # Wrong admin passwords on one process lock the address out on the other, the right
        # password included.
        with requests.Session() as session:
            for _ in range(2):
                assert admin_login(session, first, "wrong").status_code == 200  # the form again
            assert admin_login(session, first, "wrong").status_code == 429
        with requests.Session() as session:
            refused = admin_login(session, second, "the-right-password")
            assert refused.status_code == 429
            assert "sessionid" not in session.cookies


def test_the_admins_lock_out_says_when_to_try_again(sigil, owner_account, settings):
    settings.AXES_FAILURE_LIMIT = 2
    settings.SIGIL_ADMIN_LOCKOUT_SECONDS = 120
    with requests.Session() as session:
        assert admin_login(session, sigil.url, "wrong").status_code == 200  # the form again
        locked = admin_login(session, sigil.url, "wrong")
        assert locked.status_code == 429
        assert locked.headers["Retry-After"] == "120"
        refused = admin_login(session, sigil.url, "the-right-password")
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "120"


def test_someone_elses_guesses_do_not_lock_the_owner_out_of_a_trusted_device(sigil, owner_account, settings):
    settings.AXES_FAILURE_LIMIT = 3
    settings.SIGIL_TRUSTED_PROXY_COUNT = 1  # addresses read from X-Forwarded-For, as behind a proxy
    owner_address, other_address = {"X-Forwarded-For": "198.51.100.7"}, {"X-Forwarded-For": "203.0.113.9"}

    with requests.Session() as browser:  # the owner's browser signs in once: it is trusted from then on
        browser.headers.update(owner_address)
        signed_in = admin_login(browser, sigil.url, "the-right-password")
        assert signed_in.status_code == 302
        cookie = next(c for c in browser.cookies if c.name == "sigil_device")
        assert cookie.path == "/admin/" and cookie.has_nonstandard_attr("HttpOnly")
        device = cookie.value

    with requests.Session() as guesser:  # a tenant on the owner's address guesses
        guesser.headers.update(owner_address)
        for _ in range(2):
            assert admin_login(guesser, sigil.url, "wrong").status_code == 200
        assert admin_login(guesser, sigil.url, "wrong").status_code == 429
        assert admin_login(guesser, sigil.url, "the-right-password").status_code == 429  # the address is locked
        forged = requests.cookies.create_cookie("sigil_device", device[:-2] + "xx", path="/admin/")
        guesser.cookies.set_cookie(forged)
        assert admin_login(guesser, sigil.url, "the-right-password").status_code == 429  # a forged cookie is none

    def owner_browser() -> requests.Session:
        session = requests.Session()
        session.headers.update(owner_address)
        session.cookies.set("sigil_device", device, path="/admin/")
        return session

    with owner_browser() as browser:  # the owner, from the locked address, on the trusted device
        assert admin_login(browser, sigil.url, "the-right-password").status_code == 302
    with requests.Session() as elsewhere:  # and from another address, as before
        elsewhere.headers.update(other_address)
        assert admin_login(elsewhere, sigil.url, "the-right-password").status_code == 302

    # The device has its own count: guesses made with it (a stolen cookie) lock it out in turn.
    with owner_browser() as browser:
        for _ in range(2):
            assert admin_login(browser, sigil.url, "wrong").status_code == 200
        locked = admin_login(browser, sigil.url, "wrong")
        assert locked.status_code == 429 and "from this browser" in " ".join(locked.text.split())
        assert admin_login(browser, sigil.url, "the-right-password").status_code == 429
    # Another user's device cookie is no trusted device for the owner.
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_superuser("deputy", "deputy@example.invalid", "the-deputys-password")
    with requests.Session() as theirs:
        theirs.headers.update(other_address)
        assert admin_login(theirs, sigil.url, "the-deputys-password", username="deputy").status_code == 302
        deputy_device = theirs.cookies.get("sigil_device", path="/admin/")
    with requests.Session() as guesser:
        guesser.headers.update(owner_address)
        guesser.cookies.set("sigil_device", deputy_device, path="/admin/")
        assert admin_login(guesser, sigil.url, "the-right-password").status_code == 429
