"""What a piece of work asks of a runtime's API: its class, which decides what it may take of
a shared budget (Cloudflare's rate budget, `cloudflare/budget.py`), and how long its calls may
wait for room in all. Both travel with the work in context variables, set where it starts:

- a call's page-in, and where a warm call's slot answers: `PAGE_IN`, set by the engine
  (`engine/placing.py:Placer.place`, `engine/sending.py:Sender.target`);
- the Celery tasks: the class each does, one table (`capabilities/tasks.py:API_CLASS_OF_TASK`),
  set by their base as a task starts;
- a process making its runtime ready at start, and `cfcheck`: `HOUSEKEEPING`, set by their
  services (`runtime_ready`, `cloudflare_check`);
- anything else is someone's request waiting on its answer (an owner's admin action, a split
  started by an agent, a management command): `DEPLOY`, the default.

A thread started for the work takes its context along (`engine/offload.py` runs each job in a
copy of its caller's), so the class follows the work across the engine's pool.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import time
from collections.abc import Iterator


class ApiClass(enum.Enum):
    """The classes of API work, in the order the budget serves them: a call waiting on its
    page-in, then deploys and rollbacks, then page-outs, then housekeeping (reconcile, prewarm,
    expiry, stats, provisioning probes, cfcheck, the collection of call records)."""

    PAGE_IN = "page-in"
    DEPLOY = "deploy"
    PAGE_OUT = "page-out"
    HOUSEKEEPING = "housekeeping"

    @property
    def waits(self) -> bool:
        """Whether work of this class waits for room: housekeeping never does. It skips, and
        runs again at its next beat, so that it never holds room that work above it waits for."""
        return self is not ApiClass.HOUSEKEEPING


_CLASS: contextvars.ContextVar[ApiClass] = contextvars.ContextVar("api_class", default=ApiClass.DEPLOY)
# The latest moment (monotonic) a wait for room may reach in this context: set around a piece of
# work made of several API calls (a page-in: the upload, the toggle, the victims' deletes), so
# that their waits together stay within one allowance instead of one each.
_WAIT_UNTIL: contextvars.ContextVar[float | None] = contextvars.ContextVar("api_wait_until", default=None)


def current_api_class() -> ApiClass:
    """The class of the work this code runs for (DEPLOY when nobody said)."""
    return _CLASS.get()


def wait_allowance() -> float | None:
    """Seconds the calls of this context may still wait for room, in all; None: no limit set
    here (the budget's own longest wait applies)."""
    until = _WAIT_UNTIL.get()
    return None if until is None else max(0.0, until - time.monotonic())


@contextlib.contextmanager
def api_work(api_class: ApiClass, *, wait_seconds: float | None = None) -> Iterator[None]:
    """The block's API calls are work of `api_class`; with `wait_seconds`, their waits for room
    end that long from now at the latest, in all (within any allowance around the block)."""
    token = _CLASS.set(api_class)
    try:
        with waits_within(wait_seconds) if wait_seconds is not None else contextlib.nullcontext():
            yield
    finally:
        _CLASS.reset(token)


@contextlib.contextmanager
def waits_within(seconds: float) -> Iterator[None]:
    """Every wait for room in the block ends `seconds` from now at the latest, in all."""
    until = time.monotonic() + seconds
    outer = _WAIT_UNTIL.get()
    token = _WAIT_UNTIL.set(until if outer is None else min(outer, until))
    try:
        yield
    finally:
        _WAIT_UNTIL.reset(token)
