"""Ending the work a dead process held: every accepted deploy, rollback and page-out ends,
and every mark it held in what the hosts share is freed, within a bound.

A Celery worker's main process killed with -9 acknowledges nothing: the broker gives its
tasks to another worker only after its visibility timeout (settings). What it held is
owned by leases (sigil/leases.py), so a lease after its death this reaper, run by
beat every SIGIL_REAP_INTERVAL_SECONDS (and by reconcile), finds the work nobody owns and
sends it again or ends it with a recorded outcome. Bound: SIGIL_LEASE_SECONDS plus
SIGIL_REAP_INTERVAL_SECONDS until a resend (30 s by default), and a deploy no worker takes
after DEPLOY_RESENDS resends is failed one interval later each (about a minute).
"""

from __future__ import annotations

from capabilities.services.placement import capability_reap_placements
from capabilities.services.registry import capability_reap_deploys


def capability_reap() -> dict[str, int]:
    """Send again, or end, the deploys, rollbacks and page-outs whose owner died, and free
    the `placing` entries of dead placers. Idempotent; returns the counts of each."""
    return {**capability_reap_deploys(), **capability_reap_placements()}
