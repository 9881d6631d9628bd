"""What a test (or `manage.py cfemulator`) may change while the emulator runs, and the
credentials it accepts when none are given."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from cfemulator.api_common import _LABEL
from cfemulator.limits import DEFAULT_CPU_MS, MAX_CPU_MS
from cfemulator.ratelimit import parse_rate_limit

# Credentials the emulator accepts when none are configured (CF_API_TOKEN, CF_ACCOUNT_ID).
DEV_TOKEN = "sigil-emulator-dev-token"
DEV_ACCOUNT_ID = "5169110000000000000000000000e001"
PLANS = frozenset({"free", "paid"})
# Worker scripts an account may hold on each plan (reference §7.3): changing the plan sets
# `script_limit` to its plan's unless the same change sets it.
PLAN_SCRIPT_LIMITS = {"free": 100, "paid": 500}
# Settings that are a number of at least 0 (fault_rate: at most 1 as well).
_SECONDS_OR_FRACTION = (
    "latency",
    "fault_rate",
    "propagation_delay",
    "kv_propagation_seconds",
    "kv_miss_cache_seconds",
    "dynamic_idle_seconds",
)


@dataclass(frozen=True)
class EmulatorConfig:
    """What a test (or `manage.py cfemulator`) may change while the emulator runs."""

    script_limit: int = 500
    latency: float = 0.0
    fault_rate: float = 0.0
    fault_seed: int | None = None
    # Fail exactly the next N API calls with a 5xx (deterministic fault injection).
    fail_next: int = 0
    rate_limit: int = 1200
    rate_window: float = 300.0
    # Cloudflare's Paid plan limit, measured after compression (reference §7.3).
    script_max_bytes: int = 10 * 1024 * 1024
    subdomain: str = "sigil-emulator"
    # The CPU limit of a call to a script that sets none: the Paid plan's 30 s (Free: 10 ms).
    default_cpu_ms: int = DEFAULT_CPU_MS
    # CPU ms a call may use past its limit before it is stopped (see cfemulator.cpumeter).
    cpu_grace_ms: int = 100
    # The account's plan: "paid" (Workers Paid) or "free". Dynamic Worker Loader needs Paid.
    plan: str = "paid"
    # Whether the account subscribes to Workers for Platforms (dispatch namespaces).
    workers_for_platforms: bool = True
    # The code of the 404 for a missing dispatch namespace. No public source gives the real
    # one, so tests run the client against 10007 and against another code.
    namespace_not_found_code: int = 10007
    # Seconds before a change reaches the Workers runtime, as Cloudflare's propagation: a new
    # script (its API calls answer 10007 and its URL 404 until then), a workers.dev toggle.
    # 0: at once.
    propagation_delay: float = 0.0
    # Seconds a location of the Workers runtime keeps a KV value it read (or wrote through its
    # binding) before it reads the central store again: a write made elsewhere reaches a location
    # that holds the key within this long. Workers KV's docs ("How KV works"): changes are
    # "immediately visible in the ... location at which they are made" and "may take up to 60
    # seconds or more to be visible in other global network locations as their cached versions
    # of the data time out". A location that holds nothing reads the central store, as the API
    # does. 0: every read reads the central store.
    kv_propagation_seconds: float = 60.0
    # Seconds a Worker's KV read that found nothing keeps answering "not found" at its
    # location, even once the key is written over the API: Cloudflare caches a miss for the
    # read's cacheTtl, 60 s by default (KV docs, "How KV works"). A write through the binding
    # itself is seen at once where it was made. 0: misses are not cached.
    kv_miss_cache_seconds: float = 60.0
    # Answer a successful DELETE with 200 and no body at all, as some of Cloudflare's
    # endpoints are documented to ("This call has no response body on a successful delete"),
    # instead of the envelope with a null result.
    empty_delete_answers: bool = False
    # Seconds after its last call a Dynamic Worker's process is stopped (cfemulator.dynamic);
    # its next call starts one again and loads its code afresh, as a cold isolate would.
    dynamic_idle_seconds: float = 60.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["rate_limit"] = f"{self.rate_limit}/{self.rate_window:g}"
        del data["rate_window"]
        return data

    def updated(self, changes: dict[str, Any]) -> EmulatorConfig:
        """A copy with `changes` applied (keys as in `to_json`). Raises ValueError."""
        known = {f.name for f in fields(self)} - {"rate_window"}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for key, value in changes.items():
            if key == "rate_limit":
                values["rate_limit"], values["rate_window"] = parse_rate_limit(str(value))
            elif key in ("script_limit", "fail_next", "script_max_bytes", "cpu_grace_ms", "namespace_not_found_code"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{key} must be a whole number, at least 0")
                values[key] = value
            elif key == "default_cpu_ms":
                if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_CPU_MS:
                    raise ValueError(f"default_cpu_ms is a whole number of ms, 1 to {MAX_CPU_MS}")
                values[key] = value
            elif key in _SECONDS_OR_FRACTION:
                if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{key} must be a number, at least 0")
                if key == "fault_rate" and value > 1:
                    raise ValueError("fault_rate is a fraction, between 0 and 1")
                values[key] = float(value)
            elif key == "fault_seed":
                if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                    raise ValueError("fault_seed must be a whole number or null")
                values[key] = value
            elif key == "plan":
                if value not in PLANS:
                    raise ValueError(f"plan is one of {sorted(PLANS)}")
                values[key] = value
                if "script_limit" not in changes:
                    values["script_limit"] = PLAN_SCRIPT_LIMITS[value]
            elif key in ("workers_for_platforms", "empty_delete_answers"):
                if not isinstance(value, bool):
                    raise ValueError(f"{key} is true or false")
                values[key] = value
            elif key == "subdomain":
                if not isinstance(value, str) or (value and not re.fullmatch(_LABEL, value)):
                    raise ValueError("subdomain must be one lowercase DNS label, or empty for none")
                values[key] = value
        return replace(self, **values)
