"""Real Celery workers inside the test process, each in a thread with a threads pool."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager

# How long the workers may take to stop at the end of the session (a task still running).
STOP_SECONDS = 60


@contextmanager
def workers_in_threads(app, *, queues: dict[str, list[str]]):
    """One worker per entry of `queues` (hostname: the queues it consumes), started in turn
    and stopped together: Celery's stop flag is one per process, so stopping one worker
    alone (as `celery.contrib.testing.worker.start_worker` does) also stops, or cuts off,
    the others. Yields {hostname: worker}."""
    from celery.contrib.testing.worker import WORKER_LOGLEVEL, TestWorkController, setup_app_for_worker
    from celery.result import _set_task_join_will_block
    from celery.worker import state
    from kombu.asynchronous import set_event_loop

    setup_app_for_worker(app, WORKER_LOGLEVEL, None)
    started: list[tuple[TestWorkController, threading.Thread]] = []
    try:
        for hostname, consumed in queues.items():
            # Each worker needs an event loop of its own: Celery takes the process's current
            # loop when there is one, and two consumer threads running one loop steal each
            # other's socket events until one of them stops taking tasks.
            set_event_loop(None)
            worker = TestWorkController(
                app=app,
                hostname=hostname,
                queues=consumed,
                pool="threads",
                concurrency=2,
                # A deep prefetch: with the threads pool (a blocking consumer loop) and late
                # acks, a worker holding its full prefetch of 2 sometimes waits seconds before
                # fetching again; 32 is never reached here. Production workers use prefork.
                prefetch_multiplier=16,
                loglevel=WORKER_LOGLEVEL,
                logfile=None,
                ready_callback=None,
                without_heartbeat=True,
                without_mingle=True,
                without_gossip=True,
            )
            thread = threading.Thread(target=worker.start, name=f"celery {hostname}", daemon=True)
            thread.start()
            worker.ensure_started()
            started.append((worker, thread))
        _set_task_join_will_block(False)
        yield {worker.hostname: worker for worker, _ in started}
    finally:
        state.should_terminate = 0
        deadline = time.monotonic() + STOP_SECONDS
        for _, thread in started:
            thread.join(max(0.0, deadline - time.monotonic()))
        state.should_terminate = None
        stuck = [(worker.hostname, thread) for worker, thread in started if thread.is_alive()]
        if stuck:
            # Daemon threads end with the process; say where each was, rather than fail a
            # session whose tests have all run.
            frames = sys._current_frames()
            where = "\n".join(f"{name}:\n{''.join(traceback.format_stack(frames[t.ident]))}" for name, t in stuck)
            warnings.warn(f"Celery workers still running {STOP_SECONDS} s after the session:\n{where}", stacklevel=1)


def process_environment(settings, **extra: str) -> dict[str, str]:
    """The environment of a Sigil process a test starts on the worker-pool runtime: the test's
    database, Redis and Cloudflare settings (the emulator), and the pool's sizes; `extra` adds
    to it (another SIGIL_VAR_DIR: another host)."""
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        database_url = f"sqlite:///{db['NAME']}"
    else:
        database_url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        "SIGIL_BACKEND": "worker-pool",
        "CF_API_BASE": settings.CF_API_BASE,
        "CF_API_TOKEN": settings.CF_API_TOKEN,
        "CF_ACCOUNT_ID": settings.CF_ACCOUNT_ID,
        "SIGIL_CF_WORKERS_BASE": settings.SIGIL_CF_WORKERS_BASE,
        "SIGIL_POOL_TOTAL_QUOTA": str(settings.SIGIL_POOL_TOTAL_QUOTA),
        "SIGIL_POOL_SYSTEM_RESERVED": str(settings.SIGIL_POOL_SYSTEM_RESERVED),
        "SIGIL_POOL_USER_RESERVED": str(settings.SIGIL_POOL_USER_RESERVED),
        "SIGIL_POOL_SAFETY_MARGIN": str(settings.SIGIL_POOL_SAFETY_MARGIN),
        "SIGIL_PLACEMENT_LOCK_SECONDS": str(settings.SIGIL_PLACEMENT_LOCK_SECONDS),
        "SIGIL_LEASE_SECONDS": str(settings.SIGIL_LEASE_SECONDS),
        "SIGIL_INTERNAL_SECRET": settings.SIGIL_INTERNAL_SECRET,
        "SIGIL_DEPLOY_COOLDOWN_SECONDS": "0",
        "SIGIL_LOGS_ENABLED": "true" if settings.SIGIL_LOGS_ENABLED else "false",
        **extra,
    }


def start_worker_process(settings, *, queue: str, **extra: str):
    """A Celery worker in a process of its own (solo pool: its main process runs the tasks),
    consuming `queue` (comma-separated), on the test's database, Redis and Cloudflare
    settings, in a session of its own so a test can kill it with os.killpg."""
    worker = ["-m", "celery", "-A", "sigil_site", "worker", "-Q", queue, "--pool", "solo", "-l", "WARNING"]
    return _process_on_test_settings(settings, worker, **extra)


def start_service_process(settings, code: str):
    """`code` (Python, after django.setup()) run in a process of its own, on the settings
    start_worker_process gives, in a session of its own so a test can kill it mid-work."""
    return _process_on_test_settings(settings, ["-c", f"import django\ndjango.setup()\n{code}"])


def _process_on_test_settings(settings, args: list[str], **extra: str):
    return subprocess.Popen(
        [sys.executable, *args],
        env=process_environment(settings, **extra),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


# For start_service_process: a page-in of alice--a, as the engine's cold path makes it.
PAGE_IN_A = 'from capabilities import services\nservices.capability_page_in(full="alice--a")'
