"""Values built from settings, each field naming the setting it is read from, once:

@dataclass(frozen=True)
class Limits(FromSettings):
    most: int = setting("SIGIL_MOST")

Limits.from_settings()  # Limits(most=settings.SIGIL_MOST)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self

from django.conf import settings

_SETTING = "setting"


def setting(name: str) -> Any:
    """A dataclass field that from_settings() reads from settings.`name` (no default: built by
    hand, the value is given)."""
    return dataclasses.field(metadata={_SETTING: name})


class FromSettings:
    """A dataclass whose `setting` fields from_settings() fills from the settings they name."""

    @classmethod
    def from_settings(cls) -> Self:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        return cls(**{f.name: getattr(settings, f.metadata[_SETTING]) for f in fields if _SETTING in f.metadata})
