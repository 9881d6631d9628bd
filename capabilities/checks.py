"""System checks for settings that only make sense together."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, register

KNOWN_BACKENDS = ("local",)


@register()
def check_backend(app_configs, **kwargs) -> list[Error]:
    if settings.SIGIL_BACKEND not in KNOWN_BACKENDS:
        return [
            Error(
                f"SIGIL_BACKEND is {settings.SIGIL_BACKEND!r}",
                hint=f"Use one of: {', '.join(KNOWN_BACKENDS)}.",
                id="sigil.E001",
            )
        ]
    return []
