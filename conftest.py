"""Session-wide fixtures: workerd and Redis (their addresses come from testsupport.environment)."""

from __future__ import annotations

import contextlib

import pytest


@pytest.fixture(scope="session")
def workerd_group():
    """The local runtime's workerd processes for the whole session (per xdist worker),
    supervised in a thread as runworkerd supervises them: one per agent, started on the
    agent's first placement and kept for the rest of the session."""
    import threading

    from capabilities.log_sink import local_workerd_group
    from capabilities.workerd.group import read_status
    from testsupport.processes import wait_until

    group = local_workerd_group()
    stop = threading.Event()
    thread = threading.Thread(target=group.run, args=(stop,), name="workerd-group", daemon=True)
    thread.start()
    wait_until(lambda: read_status(group.status_path), timeout=10, what="the workerd supervisor's status")
    yield group
    stop.set()
    thread.join(30)


@pytest.fixture
def redis_client():
    """The Redis Sigil uses, emptied before each test."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _fresh_redis_and_runtime():
    """Each test starts with an empty Redis, no local placements (the database is emptied
    too), and a runtime built from its own settings."""
    import shutil

    import redis
    from django.conf import settings

    from capabilities.runtimes import runtimes_forget

    # An earlier test's Workers on the emulator stop first: call records they still hold
    # would be pushed into this test's Redis.
    for emulator in EMULATORS_STARTED:
        emulator.reset()
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    client.close()
    shutil.rmtree(settings.SIGIL_CODE_DIR / "slots", ignore_errors=True)
    runtimes_forget()
    yield
    runtimes_forget()


@pytest.fixture(scope="session", autouse=True)
def _test_database_released(django_db_setup, django_db_blocker):
    """At the session's end, close the connections that threads of the session (the server's,
    the Celery workers') still hold to the test database on PostgreSQL, which would not drop
    it otherwise and leave it behind."""
    yield
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


@pytest.fixture(scope="session")
def _sigil_server_thread(django_db_setup, django_db_blocker, workerd_group):
    """Sigil's ASGI application (the engine in front of Django) on a free loopback port,
    served by uvicorn in a thread of this process, lifespan and all (the async call runners)."""
    import socket
    import threading

    import uvicorn
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    from capabilities.runtimes import runtimes_forget
    from sigil_site.asgi import SigilApplication, django_application
    from testsupport.inflight import SERVER_REQUESTS, RequestsInFlight
    from testsupport.processes import wait_until

    # Static files served as `runsigil` serves them, so that the admin has its style sheets
    # in browser tests.
    app = SigilApplication(ASGIStaticFilesHandler(django_application))
    requests = RequestsInFlight(app)
    SERVER_REQUESTS.append(requests)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(requests, lifespan="on", log_level="warning", access_log=False, timeout_keep_alive=75)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="sigil-server", daemon=True)
    with django_db_blocker.unblock():
        thread.start()
        wait_until(lambda: server.started, timeout=30, what="the test server to start")
    # Importing the application made the runtime of the moment ready, and kept it: the test
    # that starts the server may be about to choose another.
    runtimes_forget()
    yield port, app
    SERVER_REQUESTS.remove(requests)
    server.should_exit = True
    thread.join(30)


class SigilServer:
    def __init__(self, url: str, app) -> None:
        self.url = url
        self.app = app


@pytest.fixture
def sigil(_sigil_server_thread, transactional_db):
    """The running server for this test; its engine is rebuilt from this test's settings.

    Where an earlier test started the session's Celery workers, they consume what this test's
    calls queue (a breaker change) even though it asked for no worker: it ends with them idle
    too, before its database is emptied."""
    from django.conf import settings

    port, app = _sigil_server_thread
    app.reset_engine()
    queues = ["celery", settings.SIGIL_DEPLOY_QUEUE] if CELERY_WORKERS_STARTED else []
    with _left_idle(queues) if queues else contextlib.nullcontext():
        yield SigilServer(f"http://127.0.0.1:{port}", app)
    app.reset_engine()


#: set once this process's session Celery workers run (they run until the session ends)
CELERY_WORKERS_STARTED: list[bool] = []


@pytest.fixture(scope="session")
def _celery_workers(django_db_setup, django_db_blocker):
    """Two real Celery workers consuming from the test Redis, in this process: one for
    every queue but the deploys', one for the deploys' (see `celery_deploy_worker`)."""
    import os

    from django.conf import settings

    from sigil_site.celery import app
    from testsupport.celery_workers import workers_in_threads

    app.loader.import_default_modules()
    queues = {f"tasks-{os.getpid()}@test": ["celery"], f"deploys-{os.getpid()}@test": [settings.SIGIL_DEPLOY_QUEUE]}
    with django_db_blocker.unblock(), workers_in_threads(app, queues=queues) as workers:
        CELERY_WORKERS_STARTED.append(True)
        yield dict(zip(("tasks", "deploys"), workers.values(), strict=True))


@pytest.fixture(scope="session")
def celery_worker_session(_celery_workers):
    """The worker for every queue but the deploys'."""
    return _celery_workers["tasks"]


@pytest.fixture(scope="session")
def celery_deploy_worker_session(_celery_workers):
    """The worker for the deploys' queue only: a deploy waiting on its placement never queues
    behind page-outs on the other worker's two threads (nor do page-outs wait for room that
    only they can free)."""
    return _celery_workers["deploys"]


@contextlib.contextmanager
def _left_idle(queues: list[str]):
    """Wait, as the test ends, for the Celery tasks it started to finish, and revoke what it
    queued that has not run yet.

    The database is emptied after each test. A task still running then holds rows that
    PostgreSQL's TRUNCATE must wait for (and may deadlock on), and a retry scheduled for later
    would run against the next test's rows.
    """
    import os
    import time

    import redis
    from celery.signals import task_received
    from celery.worker import state as worker_state

    from testsupport.inflight import SERVER_REQUESTS

    received = []

    def remember(request, **kwargs):
        received.append(request.id)

    task_received.connect(remember, weak=False)
    yield
    # The session's Redis, where the workers take their tasks (testsupport/environment.py),
    # whatever Redis the test pointed Sigil at meanwhile.
    broker = redis.Redis.from_url(os.environ["REDIS_URL"])
    deadline = time.monotonic() + 30
    try:
        # A response still closing may queue a task yet (a breaker change).
        for server in SERVER_REQUESTS:
            server.wait_idle(timeout=10)
        while time.monotonic() < deadline:
            worker_state.revoked.update(received)
            queued = sum(broker.llen(queue) for queue in queues)
            if not (worker_state.active_requests or worker_state.reserved_requests or queued):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(
                f"the Celery worker was still busy 30 s after the test ended: "
                f"{len(worker_state.active_requests)} running, {queued} queued"
            )
    finally:
        task_received.disconnect(remember)
        broker.close()


@pytest.fixture
def celery_worker(celery_worker_session, transactional_db):
    """The session's Celery worker, left idle when the test ends (see `_left_idle`)."""
    with _left_idle(["celery"]):
        yield celery_worker_session


@pytest.fixture
def celery_deploy_worker(celery_deploy_worker_session, transactional_db):
    """The session's worker for deploys (the Cloudflare runtimes place them in Celery), left
    idle when the test ends."""
    from django.conf import settings

    with _left_idle([settings.SIGIL_DEPLOY_QUEUE]):
        yield celery_deploy_worker_session


@pytest.fixture
def alice(sigil, settings):
    """The acting agent. Deploy cool-down is off unless a test turns it on."""
    from testsupport.cast import make_agent

    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 0
    return make_agent("alice", sigil.url)


@pytest.fixture
def bob(sigil):
    """A second agent, who must not see alice's private capabilities."""
    from testsupport.cast import make_agent

    return make_agent("bob", sigil.url)


@pytest.fixture(scope="session")
def cf_emulator():
    """One Cloudflare emulator for the whole session (per xdist worker), over real HTTP.

    It listens on a free port of 127.0.0.1 with its own workerd; yields an EmulatorControl
    (`api_base`, `token`, `account_id`, `configure()`, `reset()`, `api_calls()`, ...).
    Tests normally take `cf_emulator_fresh`, which resets it first.
    """
    from django.conf import settings

    from testsupport.emulator import EmulatorControl, emulator_server

    server = emulator_server(workerd_binary=settings.SIGIL_WORKERD_BIN, state_dir=settings.VAR_DIR / "cfemulator")
    server.start()
    control = EmulatorControl.of(server)
    EMULATORS_STARTED.append(control)
    yield control
    EMULATORS_STARTED.remove(control)
    server.stop()


#: the session's Cloudflare emulator, once started (each test stops its Workers first)
EMULATORS_STARTED: list = []


@pytest.fixture
def cf_emulator_fresh(cf_emulator):
    """The session's Cloudflare emulator, reset: no scripts, start config, empty request log.

    Change its config for one test with `cf_emulator_fresh.configure(script_limit=3, ...)`;
    the next test's reset undoes it.
    """
    cf_emulator.reset()
    return cf_emulator


@pytest.fixture
def cf_settings(settings, cf_emulator_fresh, _sigil_server_thread):
    """Django settings pointed at the fresh emulator, for code that builds its client from
    settings; Sigil's Workers there push call records to the session's server."""
    settings.CF_API_BASE = cf_emulator_fresh.api_base
    settings.CF_ACCOUNT_ID = cf_emulator_fresh.account_id
    settings.CF_API_TOKEN = cf_emulator_fresh.token
    settings.SIGIL_ORIGIN_URL = f"http://127.0.0.1:{_sigil_server_thread[0]}"
    # Deploys on a Cloudflare runtime are placed by a Celery task: tests read their outcome,
    # however loaded the machine; the 202 of a deploy still placing has its own test.
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 60
    return settings


@pytest.fixture
def cf_client(cf_emulator_fresh, redis_client):
    """A CloudflareClient on the fresh emulator and the test's Redis, with short backoffs."""
    from testsupport.emulator import cloudflare_client

    client = cloudflare_client(
        cf_emulator_fresh,
        redis_client,
        max_retries=4,
        max_rate_wait_seconds=10.0,
        backoff_base_seconds=0.01,
        backoff_max_seconds=0.1,
    )
    yield client
    client.close()


@pytest.fixture
def worker_pool(cf_settings, cf_emulator_fresh, celery_deploy_worker):
    """Sigil on the worker-pool runtime, against the fresh emulator: a quota of 8 scripts,
    1 + 2 reserved and a margin of 2, so 3 slots. Returns the emulator's control."""
    cf_settings.SIGIL_BACKEND = "worker-pool"
    cf_settings.SIGIL_CF_WORKERS_BASE = cf_emulator_fresh.url
    cf_settings.SIGIL_POOL_TOTAL_QUOTA = 8
    cf_settings.SIGIL_POOL_SYSTEM_RESERVED = 1
    cf_settings.SIGIL_POOL_USER_RESERVED = 2
    cf_settings.SIGIL_POOL_SAFETY_MARGIN = 2
    # The system script is the edge's Worker while the edge is on; Sigil's Tail Worker lives
    # elsewhere: call records are off here, and capabilities/tests/test_call_logs_runtimes.py
    # turns them on with the account's full quota.
    cf_settings.SIGIL_LOGS_ENABLED = False
    cf_emulator_fresh.configure(script_limit=8 if cf_settings.SIGIL_EDGE else 8 - 1)
    return cf_emulator_fresh


@pytest.fixture
def own_redis(tmp_path, settings, sigil):
    """Sigil on a Redis server of this test's own, which the test may stop, kill and start
    again: durable as `make run`'s, its append-only file in the test's directory."""
    from sigil.embedded_redis import EmbeddedRedis
    from sigil.redis_client import get_redis

    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    settings.REDIS_URL = server.url
    get_redis.cache_clear()
    sigil.app.gateway = None  # rebuilt on the next call, on this Redis
    yield server
    server.stop()
    get_redis.cache_clear()
    sigil.app.gateway = None


@pytest.fixture
def webhook_receiver():
    from testsupport.cast import WebhookReceiver

    receiver = WebhookReceiver()
    yield receiver
    receiver.stop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so fixtures can tell a failed test."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def browser_thread():
    """Debian's Chromium under Playwright, one per session (per xdist worker), in its own thread."""
    from testsupport.browser import BrowserThread

    thread = BrowserThread()
    yield thread
    thread.stop()


@pytest.fixture
def page(browser_thread, request):
    """A fresh browser context and page for one test; a failed test leaves a screenshot in test-artifacts/."""
    from testsupport.browser import DESKTOP, screenshot, watch_console

    context = browser_thread.browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(15_000)
    page = context.new_page()
    console_errors = watch_console(page)
    yield page
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        screenshot(page, f"failed-{request.node.name}", phone=False)
    context.close()
    # A page that broke its own Content-Security-Policy, or whose script failed, says so here.
    assert not console_errors, f"the browser's console showed errors: {console_errors}"


@pytest.fixture
def owner(sigil, page):
    """The owner, a superuser, signed in to the admin in `page`."""
    from django.contrib.auth import get_user_model

    from testsupport.browser import log_in

    password = "owner-password-for-tests"
    get_user_model().objects.create_superuser("owner", "owner@example.invalid", password)
    log_in(page, sigil.url, username="owner", password=password)
    return page


@pytest.fixture
def platform(cf_settings, cf_emulator_fresh, celery_deploy_worker):
    """Sigil on the platform runtime, against the fresh emulator: capabilities in a dispatch
    namespace behind the repo's dispatch Worker, deployed by the first placement. Returns
    the emulator's control."""
    cf_settings.SIGIL_BACKEND = "platform"
    cf_settings.SIGIL_CF_WORKERS_BASE = cf_emulator_fresh.url
    return cf_emulator_fresh


@pytest.fixture
def loader(cf_settings, cf_emulator_fresh, celery_deploy_worker):
    """Sigil on the loader runtime, against the fresh emulator: code in KV, run by the repo's
    loader host deployed as a Worker with a Worker Loader, by the first placement. Returns
    the emulator's control."""
    cf_settings.SIGIL_BACKEND = "loader"
    cf_settings.SIGIL_CF_WORKERS_BASE = cf_emulator_fresh.url
    return cf_emulator_fresh


@pytest.fixture
def access_log(caplog):
    """The engine's access lines, each parsed from its JSON form."""
    import json
    import logging

    from sigil.logs import SigilFormatter

    caplog.set_level(logging.INFO, logger="sigil.access")
    as_json = SigilFormatter(kind="json")
    return lambda: [json.loads(as_json.format(r)) for r in caplog.records if r.name == "sigil.access"]


@pytest.fixture
def workerd_output(caplog):
    """The lines workerd processes have printed so far (a script's console.log among them),
    as they are relayed to Sigil's log."""
    import logging

    from capabilities.workerd.host import output_logger

    caplog.set_level(logging.INFO, logger=output_logger.name)
    return lambda: [record.getMessage() for record in caplog.records if record.name == output_logger.name]
