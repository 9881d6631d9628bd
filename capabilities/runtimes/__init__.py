"""The runtime registry: SIGIL_BACKEND names one runtime, built once per process."""

from __future__ import annotations

import functools

from django.conf import settings
from django.utils.module_loading import import_string

from capabilities.runtimes.base import Runtime

# The one list of runtimes: SIGIL_BACKEND's values, each naming the class that builds itself
# from settings (Runtime.from_settings). The checks and commands read their choices here.
RUNTIMES = {
    "local": "capabilities.runtimes.local.LocalRuntime",
    "worker-pool": "capabilities.runtimes.worker_pool.WorkerPoolRuntime",
    "platform": "capabilities.runtimes.platform.PlatformRuntime",
    "loader": "capabilities.runtimes.loader.LoaderRuntime",
}


def runtime_class(backend: str) -> type[Runtime]:
    """The class of the runtime named `backend`, which states its facts (Runtime's class
    methods: on Cloudflare or not, its checks, bills and processes) without being built.
    Raises ValueError for unknown names."""
    if backend not in RUNTIMES:
        raise ValueError(f"unknown SIGIL_BACKEND {backend!r}")
    return import_string(RUNTIMES[backend])


def runtime_classes() -> list[type[Runtime]]:
    """Every runtime's class, in RUNTIMES' order."""
    return [runtime_class(backend) for backend in RUNTIMES]


def build_runtime(backend: str) -> Runtime:
    """Construct the runtime named `backend` from settings. Raises ValueError for unknown names."""
    return runtime_class(backend).from_settings()


@functools.cache
def get_runtime() -> Runtime:
    """The process's runtime, as SIGIL_BACKEND selects."""
    return build_runtime(settings.SIGIL_BACKEND)


def runtime_for(backend: str) -> Runtime:
    """The runtime a capability placed on `backend` is reached and removed through: the
    process's own runtime, or ("" meaning it too) the one a switch of SIGIL_BACKEND is
    moving capabilities away from. Raises ValueError for an unknown backend."""
    current = get_runtime()
    if not backend or backend == current.name:
        return current
    return _previous_runtime(backend)


@functools.cache
def _previous_runtime(backend: str) -> Runtime:
    return build_runtime(backend)


def runtimes_forget() -> None:
    """Build every runtime afresh from settings on next use (tests that change settings)."""
    get_runtime.cache_clear()
    _previous_runtime.cache_clear()
