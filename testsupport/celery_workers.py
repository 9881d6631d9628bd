"""Real Celery workers inside the test process, each in a thread with a threads pool."""

from __future__ import annotations

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
