"""What a month on a runtime costs: the traffic it bills, its bill, and Cloudflare's prices.

Each runtime states its own bill (Runtime.bills); the cost estimate (capabilities/cost.py)
measures the traffic and asks every runtime. Cloudflare's prices are one dated table, the
defaults of `Prices`, read from Cloudflare's pages on PRICES_READ_ON (PRICE_SOURCES); the
owner replaces any of them with SIGIL_CLOUDFLARE_PRICES, a JSON object (`prices_with`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

PRICES_READ_ON = "2026-12-01"
# Where each group of the table was read (on PRICES_READ_ON; also in Sigil's Cloudflare
# reference, §4 and §5.1 for the prices, §7.3 for the free plan's limits).
PRICE_SOURCES = {
    "free": "https://developers.cloudflare.com/workers/platform/limits/",
    "paid": "https://developers.cloudflare.com/workflows/reference/pricing/ (the Workers Standard rates, restated)",
    "platforms": "https://developers.cloudflare.com/cloudflare-for-platforms/workers-for-platforms/reference/pricing/"
    " (last updated 2026-04-21)",
    "dynamic": "https://developers.cloudflare.com/dynamic-workers/pricing/ (announced ahead of billing)",
    "kv": "https://developers.cloudflare.com/kv/platform/pricing/ (operations through the REST API are billed too)",
    "tail": "https://developers.cloudflare.com/workers/observability/logs/tail-workers/ (Workers Paid and "
    "Enterprise only; billed by CPU time, not by the number of requests)",
}


@dataclass(frozen=True)
class Prices:
    """Cloudflare's published prices and included amounts: the defaults are the table."""

    # Workers Free ("free"): requests a day, CPU ms per call, Workers per account.
    free_requests_per_day: int = 100_000
    free_cpu_ms_per_call: int = 10
    free_scripts: int = 100
    # Workers Paid ("paid"; also the plan Dynamic Workers need): the monthly minimum and what
    # it includes a month, then the Standard usage rates every paid plan bills beyond that.
    paid_monthly_usd: float = 5.0
    paid_included_requests: int = 10_000_000
    paid_included_cpu_ms: int = 30_000_000
    requests_per_million_usd: float = 0.30
    cpu_per_million_ms_usd: float = 0.02
    # Workers for Platforms ("platforms"): the monthly fee, what it includes, each script beyond.
    platforms_monthly_usd: float = 25.0
    platforms_included_requests: int = 20_000_000
    platforms_included_cpu_ms: int = 60_000_000
    platforms_included_scripts: int = 1000
    platforms_script_usd: float = 0.02
    # Dynamic Workers ("dynamic"): unique Dynamic Workers included a month, then each a day.
    dynamic_included_workers: int = 1000
    dynamic_worker_day_usd: float = 0.002
    # Workers KV ("kv"): on Workers Free, operations a day (past them, operations fail); on
    # Workers Paid, included a month, then a price a million. Each key read, written or deleted,
    # and each list request, counts, through a binding or the REST API alike.
    free_kv_reads_per_day: int = 100_000
    free_kv_writes_per_day: int = 1000
    free_kv_deletes_per_day: int = 1000
    free_kv_lists_per_day: int = 1000
    kv_included_reads: int = 10_000_000
    kv_reads_per_million_usd: float = 0.50
    kv_included_writes: int = 1_000_000
    kv_writes_per_million_usd: float = 5.00
    kv_included_deletes: int = 1_000_000
    kv_deletes_per_million_usd: float = 5.00
    kv_included_lists: int = 1_000_000
    kv_lists_per_million_usd: float = 5.00

    def plan_lines(self, plan: str, *, requests: float, cpu_ms: float) -> dict[str, float]:
        """The lines of a month on `plan` ("paid" or "platforms"): its fee, then the requests
        and CPU time beyond what it includes, at the Standard usage rates."""
        return {
            "plan": getattr(self, f"{plan}_monthly_usd"),
            "requests": overage(requests, getattr(self, f"{plan}_included_requests"), self.requests_per_million_usd),
            "cpu": overage(cpu_ms, getattr(self, f"{plan}_included_cpu_ms"), self.cpu_per_million_ms_usd),
        }

    def kv_line(self, usage: Usage) -> float:
        """A month of `usage`'s KV operations on Workers Paid, beyond what it includes."""
        return sum(
            overage(
                getattr(usage, f"kv_{kind}"),
                getattr(self, f"kv_included_{kind}"),
                getattr(self, f"kv_{kind}_per_million_usd"),
            )
            for kind in KV_OPERATIONS
        )

    def kv_over_free(self, usage: Usage, *, days: float = 30) -> list[str]:
        """What of `usage`'s KV operations is over Workers Free's daily limits, in words
        (a day as the month's mean, so a busier day may be over when none is said)."""
        over = []
        for kind in KV_OPERATIONS:
            per_day = getattr(usage, f"kv_{kind}") / days
            limit = getattr(self, f"free_kv_{kind}_per_day")
            if per_day > limit:
                over.append(f"about {per_day:,.0f} KV {KV_WORDS[kind]} a day, over {limit:,} a day")
        return over


# Workers KV's billed operations, as Usage and Prices name them, and in words.
KV_OPERATIONS = ("reads", "writes", "deletes", "lists")
KV_WORDS = {"reads": "reads", "writes": "writes", "deletes": "deletes", "lists": "list requests"}


def prices_with(override: str) -> Prices:
    """The table with the prices the JSON object `override` names instead (empty: the table).

    Raises ValueError naming what is wrong: not JSON, not an object, a name the table does not
    have, or a value that is not a number.
    """
    if not override.strip():
        return Prices()
    try:
        given = json.loads(override)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    if not isinstance(given, dict):
        raise ValueError("not a JSON object")
    known = {f.name for f in dataclasses.fields(Prices)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"no such price: {', '.join(unknown)} (the table has {', '.join(sorted(known))})")
    wrong = sorted(
        name for name, value in given.items() if isinstance(value, bool) or not isinstance(value, int | float)
    )
    if wrong:
        raise ValueError(f"not a number: {', '.join(wrong)}")
    return dataclasses.replace(Prices(), **given)


@dataclass(frozen=True)
class Usage:
    """A month of traffic, as the window's traffic scaled to a month."""

    calls: float
    duration_ms: float
    busiest_day_calls: int
    calls_over_free_cpu_share: float  # calls longer than the free plan's CPU limit (an upper bound)
    capabilities: int  # registered now: one script each on Workers for Platforms
    dynamic_worker_days: float  # (capability, day) pairs with a call: unique Dynamic Workers a day
    # Workers KV operations a month, billed on every plan whatever makes them: Sigil's own
    # through the API (measured: the loader runtime's bundles, the collection of call records)
    # and the tails' writes of the batches of call records it collects.
    kv_reads: float = 0.0
    kv_writes: float = 0.0
    kv_deletes: float = 0.0
    kv_lists: float = 0.0
    # Call records reach Sigil through a Tail Worker of its own (worker-pool, platform), which
    # runs once per call: billed by its CPU time, which Sigil does not see, and not offered on
    # Workers Free.
    tail_worker: bool = False


@dataclass(frozen=True)
class RuntimeBill:
    runtime: str
    plan: str
    monthly_usd: float
    requests: float
    cpu_ms: float
    items: dict[str, float]  # the bill's lines, in USD
    fits: bool = True
    limits: list[str] = field(default_factory=list)  # what does not fit, in words

    @classmethod
    def of(cls, *, runtime: str, plan: str, items: dict[str, float], requests: float, cpu_ms: float) -> RuntimeBill:
        """A bill that is the sum of its lines."""
        return cls(
            runtime=runtime,
            plan=plan,
            monthly_usd=round(sum(items.values()), 4),
            requests=requests,
            cpu_ms=cpu_ms,
            items=items,
        )


def overage(used: float, included: float, per_million: float) -> float:
    """What `used` costs beyond the `included` amount, at `per_million` USD a million."""
    return max(0.0, used - included) / 1_000_000 * per_million
