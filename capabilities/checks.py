"""System checks for settings that only make sense together."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from capabilities.runtimes import RUNTIMES, runtime_class
from capabilities.runtimes.billing import prices_with


@register()
def check_backend(app_configs, **kwargs) -> list[CheckMessage]:
    """SIGIL_BACKEND names a runtime, and the settings suit it (the runtime's own checks)."""
    if settings.SIGIL_BACKEND not in RUNTIMES:
        return [
            Error(
                f"SIGIL_BACKEND is {settings.SIGIL_BACKEND!r}",
                hint=f"Use one of: {', '.join(RUNTIMES)}.",
                id="sigil.E001",
            )
        ]
    return runtime_class(settings.SIGIL_BACKEND).settings_errors(settings)


@register()
def check_edge(app_configs, **kwargs) -> list[CheckMessage]:
    """The edge is Sigil's Worker on Cloudflare: it needs a runtime on a Cloudflare account."""
    if (
        settings.SIGIL_EDGE
        and settings.SIGIL_BACKEND in RUNTIMES
        and not runtime_class(settings.SIGIL_BACKEND).on_cloudflare
    ):
        hint = "Use SIGIL_BACKEND worker-pool, platform or loader with the edge, or SIGIL_EDGE=false."
        return [Error(f"SIGIL_EDGE is on with the {settings.SIGIL_BACKEND} runtime", hint=hint, id="sigil.E043")]
    return []


@register()
def check_cpu_limit(app_configs, **kwargs) -> list[CheckMessage]:
    """Cloudflare takes a CPU limit per call of at most 5 minutes (reference §7.3); the local
    runtime reads the same limit as its watchdog's."""
    if not 0 <= settings.SIGIL_CPU_MS <= 300_000:
        hint = "Use 1 to 300000 (ms), or 0 for Cloudflare's default."
        return [Error(f"SIGIL_CPU_MS is {settings.SIGIL_CPU_MS}", hint=hint, id="sigil.E004")]
    return []


@register()
def check_prices(app_configs, **kwargs) -> list[CheckMessage]:
    """The owner's prices for the cost estimate name prices of Cloudflare's table, as numbers."""
    try:
        prices_with(settings.SIGIL_CLOUDFLARE_PRICES)
    except ValueError as exc:
        hint = 'A JSON object of prices, e.g. {"paid_monthly_usd": 5.0}; empty: Cloudflare\'s table as Sigil read it.'
        return [Error(f"SIGIL_CLOUDFLARE_PRICES: {exc}", hint=hint, id="sigil.E005")]
    return []


@register()
def check_abuse_limits(app_configs, **kwargs) -> list[Error]:
    """A throttle or lock-out that is on needs a time to last; the JSON depth limit must
    stay below Python's recursion limit, so that a deep body meets Sigil's 400 first."""
    errors = [
        *_limit_with_duration(
            "SIGIL_AUTH_FAILURE_LIMIT", "SIGIL_AUTH_FAILURE_WINDOW_SECONDS", what="the failed-token throttle",
            needs="a window", id="sigil.E030",
        ),
        *_limit_with_duration(
            "SIGIL_ADMIN_LOGIN_FAILURE_LIMIT", "SIGIL_ADMIN_LOCKOUT_SECONDS", what="the admin's lock-out",
            needs="a duration", id="sigil.E031",
        ),
    ]  # fmt: skip
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


def _limit_with_duration(limit: str, duration: str, *, what: str, needs: str, id: str) -> list[Error]:
    """A limit that is on (above 0) needs its `duration` setting of 1 or more."""
    value = getattr(settings, limit)
    if value < 0 or (value and getattr(settings, duration) < 1):
        return [
            Error(
                f"{what} needs {limit} >= 0 and, when on, {needs}",
                hint=f"Set {duration} to 1 or more, or {limit} to 0.",
                id=id,
            )
        ]
    return []
