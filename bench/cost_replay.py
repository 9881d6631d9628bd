"""Cost estimate benchmark: how long the slot replay takes on a full access log.

    .venv/bin/python bench/cost_replay.py [--calls 100000] [--capabilities 300]

Builds an access pattern of `--calls` calls over `--capabilities` normal capabilities, each
called with a weight of 1/rank (a few hot, a long tail), and times the search for the
fewest slots keeping cold calls under 1 % (capabilities.cost.smallest_slots: a binary
search, one replay through the pager's eviction policy per step). Pure Python: no Redis,
no database.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

from harness import options

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    args = options(__doc__, calls=100_000, capabilities=300, seed=1)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sigil_site.settings")
    import django

    django.setup()
    from capabilities.cost import Access, replay_cold_calls, smallest_slots

    rng = random.Random(args.seed)
    names = [f"bench--c{i}" for i in range(args.capabilities)]
    weights = [1 / (rank + 1) for rank in range(args.capabilities)]
    chosen = rng.choices(names, weights, k=args.calls)
    accesses = [Access(at=float(i), full=full, type="normal") for i, full in enumerate(chosen)]

    started = time.perf_counter()
    slots = smallest_slots(accesses)
    search_s = time.perf_counter() - started
    started = time.perf_counter()
    cold = replay_cold_calls(accesses, slots=slots)
    one_s = time.perf_counter() - started
    print(f"{args.calls} calls over {args.capabilities} capabilities (weights 1/rank)")
    print(f"fewest slots for under 1 % cold: {slots} ({cold} cold calls, {cold / args.calls:.2%})")
    print(f"search: {search_s:.2f} s; one replay at that slot count: {one_s * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
