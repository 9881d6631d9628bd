"""System checks for settings that only make sense together."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, register

from capabilities.runtimes import RUNTIMES
from capabilities.runtimes.worker_pool import pool_slots


@register()
def check_backend(app_configs, **kwargs) -> list[Error]:
    if settings.SIGIL_BACKEND not in RUNTIMES:
        return [
            Error(
                f"SIGIL_BACKEND is {settings.SIGIL_BACKEND!r}",
                hint=f"Use one of: {', '.join(RUNTIMES)}.",
                id="sigil.E001",
            )
        ]
    return []


@register()
def check_pool_slots(app_configs, **kwargs) -> list[Error]:
    """The quota must leave slots once the reserved scripts and the margin are set aside."""
    if settings.SIGIL_BACKEND != "worker-pool":
        return []
    slots = pool_slots(
        total_quota=settings.SIGIL_POOL_TOTAL_QUOTA,
        system_reserved=settings.SIGIL_POOL_SYSTEM_RESERVED,
        user_reserved=settings.SIGIL_POOL_USER_RESERVED,
        safety_margin=settings.SIGIL_POOL_SAFETY_MARGIN,
    )
    if slots < 1:
        return [
            Error(
                f"the worker pool has {slots} slots",
                hint="SIGIL_POOL_TOTAL_QUOTA must exceed SYSTEM_RESERVED + USER_RESERVED + SAFETY_MARGIN.",
                id="sigil.E002",
            )
        ]
    return []


@register()
def check_cloudflare_credentials(app_configs, **kwargs) -> list[Error]:
    if settings.SIGIL_ON_CLOUDFLARE and not settings.CF_ACCOUNT_ID:
        return [Error("CF_ACCOUNT_ID is required with CF_API_TOKEN", id="sigil.E003")]
    return []


@register()
def check_cpu_limit(app_configs, **kwargs) -> list[Error]:
    """Cloudflare takes a CPU limit per call of at most 5 minutes (reference §7.3)."""
    if not 0 <= settings.SIGIL_CPU_MS <= 300_000:
        return [
            Error(
                f"SIGIL_CPU_MS is {settings.SIGIL_CPU_MS}",
                hint="Use 1 to 300000 (ms), or 0 for Cloudflare's default.",
                id="sigil.E004",
            )
        ]
    return []


@register()
def check_workerd_memory(app_configs, **kwargs) -> list[Error]:
    """An idle workerd with the loader host already takes about 60 MB: a lower limit would
    have the watchdog stop it as soon as it starts, again and again."""
    if settings.SIGIL_WORKERD_MEMORY_MB < 128:
        return [
            Error(
                f"SIGIL_WORKERD_MEMORY_MB is {settings.SIGIL_WORKERD_MEMORY_MB}",
                hint="Use 128 (MB) or more.",
                id="sigil.E011",
            )
        ]
    return []


@register()
def check_abuse_limits(app_configs, **kwargs) -> list[Error]:
    """A throttle or lock-out that is on needs a time to last; the JSON depth limit must
    stay below Python's recursion limit, so that a deep body meets Sigil's 400 first."""
    errors = []
    if settings.SIGIL_AUTH_FAILURE_LIMIT < 0 or (
        settings.SIGIL_AUTH_FAILURE_LIMIT and settings.SIGIL_AUTH_FAILURE_WINDOW_SECONDS < 1
    ):
        errors.append(
            Error(
                "the failed-token throttle needs SIGIL_AUTH_FAILURE_LIMIT >= 0 and, when on, a window",
                hint="Set SIGIL_AUTH_FAILURE_WINDOW_SECONDS to 1 or more, or SIGIL_AUTH_FAILURE_LIMIT to 0.",
                id="sigil.E030",
            )
        )
    if settings.SIGIL_ADMIN_LOGIN_FAILURE_LIMIT < 0 or (
        settings.SIGIL_ADMIN_LOGIN_FAILURE_LIMIT and settings.SIGIL_ADMIN_LOCKOUT_SECONDS < 1
    ):
        errors.append(
            Error(
                "the admin's lock-out needs SIGIL_ADMIN_LOGIN_FAILURE_LIMIT >= 0 and, when on, a duration",
                hint="Set SIGIL_ADMIN_LOCKOUT_SECONDS to 1 or more, or SIGIL_ADMIN_LOGIN_FAILURE_LIMIT to 0.",
                id="sigil.E031",
            )
        )
    if settings.SIGIL_TRUSTED_PROXY_COUNT < 0:
        errors.append(Error("SIGIL_TRUSTED_PROXY_COUNT cannot be negative", id="sigil.E032"))
    if not 1 <= settings.SIGIL_JSON_MAX_DEPTH <= 500:
        errors.append(
            Error(
                f"SIGIL_JSON_MAX_DEPTH is {settings.SIGIL_JSON_MAX_DEPTH}",
                hint="Use 1 to 500: deeper bodies would meet Python's recursion limit first.",
                id="sigil.E033",
            )
        )
    return errors
