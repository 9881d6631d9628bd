"""The id of the request (or Celery task) being served, for the log lines written while
serving it. Each request sets a fresh one as it starts (sigil_site/asgi.py), each task its
task id; code that answers the caller reads the same id with `current_request_id()`."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from contextvars import ContextVar

_current: ContextVar[str | None] = ContextVar("sigil_request_id", default=None)


def new_request_id() -> str:
    return secrets.token_hex(8)


def current_request_id() -> str | None:
    return _current.get()


def set_request_id(request_id: str | None) -> None:
    """The id of what this thread serves from now on (None: nothing)."""
    _current.set(request_id)


@contextlib.contextmanager
def request_id_as(request_id: str) -> Iterator[None]:
    """The id of the lines written within: those of a call served elsewhere (at the edge) and
    reported here. The id before is the current one again after."""
    token = _current.set(request_id)
    try:
        yield
    finally:
        _current.reset(token)
