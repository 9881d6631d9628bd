"""The runtime registry: SIGIL_BACKEND names one runtime, built once per process."""

from __future__ import annotations

import functools

from django.conf import settings

from capabilities.runtimes.base import Runtime


def build_runtime(backend: str) -> Runtime:
    """Construct the runtime named `backend` from settings. Raises ValueError for unknown names."""
    if backend == "local":
        from capabilities.runtimes.local import LocalRuntime, local_processes

        return LocalRuntime(
            code_dir=settings.SIGIL_CODE_DIR,
            processes=local_processes(),
            secret=settings.SIGIL_INTERNAL_SECRET,
            max_slots=settings.SIGIL_LOCAL_SLOTS or None,
            safety_margin=settings.SIGIL_POOL_SAFETY_MARGIN,
        )
    if backend == "worker-pool":
        from capabilities.cloudflare import CloudflareClient
        from capabilities.runtimes.worker_pool import WorkerPoolRuntime

        return WorkerPoolRuntime(
            client=CloudflareClient.from_settings(),
            secret=settings.SIGIL_INTERNAL_SECRET,
            total_quota=settings.SIGIL_POOL_TOTAL_QUOTA,
            system_reserved=settings.SIGIL_POOL_SYSTEM_RESERVED,
            user_reserved=settings.SIGIL_POOL_USER_RESERVED,
            safety_margin=settings.SIGIL_POOL_SAFETY_MARGIN,
            invoke_base=settings.SIGIL_CF_WORKERS_BASE,
            redirect=settings.SIGIL_POOL_REDIRECT,
        )
    if backend == "platform":
        from capabilities.cloudflare import CloudflareClient
        from capabilities.runtimes.platform import PlatformRuntime

        return PlatformRuntime(
            client=CloudflareClient.from_settings(),
            namespace=settings.SIGIL_PLATFORM_NAMESPACE,
            dispatcher=settings.SIGIL_PLATFORM_DISPATCHER,
            secret=settings.SIGIL_INTERNAL_SECRET,
            cpu_ms=settings.SIGIL_CPU_MS,
            invoke_base=settings.SIGIL_CF_WORKERS_BASE,
        )
    if backend == "loader":
        from capabilities.cloudflare import CloudflareClient
        from capabilities.runtimes.loader import LoaderRuntime

        return LoaderRuntime(
            client=CloudflareClient.from_settings(),
            worker=settings.SIGIL_LOADER_WORKER,
            kv_title=settings.SIGIL_LOADER_KV_TITLE,
            secret=settings.SIGIL_INTERNAL_SECRET,
            cpu_ms=settings.SIGIL_CPU_MS,
            invoke_base=settings.SIGIL_CF_WORKERS_BASE,
        )
    raise ValueError(f"unknown SIGIL_BACKEND {backend!r}")


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
