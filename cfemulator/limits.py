"""A Worker's CPU limit per call, and Cloudflare's answer when a Worker runs past it.

The limit of one call (docs: Workers limits, "CPU time"; Workers for Platforms custom limits):

- a script's own `limits.cpu_ms` from its upload metadata (reference §1.2);
- for a call through a dispatch namespace binding, `limits.cpuMs` of `get(name, args,
  {limits})`; when the script has its own too, the lower wins, as the docs state for a
  Dynamic Worker's two limits (reference §5.3; for dispatch it is UNCERTAIN);
- for a call to a Dynamic Worker, the lower of its code's `limits.cpuMs` and that of the
  entrypoint it is called through (`getEntrypoint(name, {limits})`), as the docs state
  (reference §5.3); with neither, the plan's default, as for any Worker;
- otherwise the plan's default: 30 s of CPU on the Paid plan (changelog 2025-03-25, "Run
  Workers for up to 5 minutes of CPU-time": "By default, Workers are still limited to 30
  seconds"), up to `MAX_CPU_MS` when a script asks; 10 ms on the Free plan.

A Worker past its limit is stopped and the client gets error 1102, "Worker exceeded resource
limits" (support docs, error-1102), with status 503 (as observed on live Workers), in the
form `Accept` asks for (`cfemulator.errorpages`). A dispatch Worker does not get the page:
its `fetch()` throws "Worker exceeded CPU time limit." (reference §4.3).
"""

from __future__ import annotations

from typing import Any

from cfemulator.errorpages import CloudflareError, ErrorAnswer, error_answer

DEFAULT_CPU_MS = 30_000
MAX_CPU_MS = 300_000
# What the dispatch namespace binding throws (reference §4.3, §7.3). The memory one is not
# documented (UNCERTAIN): it is worded as the CPU one is.
CPU_EXCEEDED_MESSAGE = "Worker exceeded CPU time limit."
MEMORY_EXCEEDED_MESSAGE = "Worker exceeded memory limit."

# The fields and wording of the JSON answer, as a live Worker's 1102 gave them (2026-08-31).
WORKER_EXCEEDED = CloudflareError(
    code=1102,
    name="worker_exceeded_resources",
    category="worker",
    status=503,
    title="Worker exceeded resource limits",
    docs="https://developers.cloudflare.com/support/troubleshooting/http-status-codes/cloudflare-1xxx-errors/error-1102/",
    detail="A Worker script configured by the website owner exceeded its resource limits (CPU time or memory) "
    "and was terminated.",
    what_to_do="**Do not retry.** The same request will hit the same resource limits. The site owner must "
    "optimize the Worker script.",
    owner_action_required=True,
)


def call_cpu_ms(script_limits: dict[str, int], dispatch_limits: Any = None, *, default: int = DEFAULT_CPU_MS) -> int:
    """The CPU limit of one call in ms: the script's `cpu_ms`, a dispatch binding's `cpuMs`
    (the lower of the two when both are set), else the plan's `default`."""
    candidates = [script_limits.get("cpu_ms")]
    if isinstance(dispatch_limits, dict):
        candidates.append(dispatch_limits.get("cpuMs"))
    given = [value for value in candidates if isinstance(value, int) and not isinstance(value, bool) and value > 0]
    return min(given) if given else default


def dynamic_cpu_ms(code_limits: Any, entrypoint_limits: Any, *, default: int = DEFAULT_CPU_MS) -> int:
    """The CPU limit of one call to a Dynamic Worker in ms: the lower of its code's `cpuMs` and
    its entrypoint's, whichever are set, else the plan's `default`."""
    candidates = [limits.get("cpuMs") for limits in (code_limits, entrypoint_limits) if isinstance(limits, dict)]
    given = [ms for ms in candidates if isinstance(ms, int | float) and not isinstance(ms, bool) and ms > 0]
    return int(min(given)) if given else default


def exceeded_answer(*, host: str, accept: str | None) -> ErrorAnswer:
    """Cloudflare's error 1102 for a request to `host`, in the form `accept` asks for."""
    return error_answer(WORKER_EXCEEDED, host=host, accept=accept)
