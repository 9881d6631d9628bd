"""Writes on capabilities, every rule of the seeds (with names.py): API views, tasks, the admin
and commands call these functions and translate their results. One module per sub-domain;
everything callers use is re-exported here."""

from capabilities.services.bindings import (
    binding_check_rename,
    binding_delete,
    binding_grant,
    binding_revoke,
    binding_save,
)
from capabilities.services.call_records import call_records_batch_keep, call_records_push
from capabilities.services.controls import (
    capability_force_degraded,
    capability_reset_breaker,
    capability_set_cpu_limit,
    capability_set_public,
)
from capabilities.services.deploy_task import capability_place_version
from capabilities.services.edge import (
    EdgeStanding,
    Published,
    edge_provision,
    edge_publish,
    edge_reconcile,
    edge_standing,
    edge_warning,
)
from capabilities.services.lifecycle import capability_mark_inactive, capability_prewarm
from capabilities.services.observability import (
    capability_apply_stats,
    capability_flush_stats,
    capability_prune_stats,
    capability_record_breaker,
)
from capabilities.services.page_outs import (
    StillInFlight,
    capability_evict,
    capability_mark_missing,
    capability_page_out,
    capability_shed_excess,
)
from capabilities.services.placement import (
    capability_clear_slot,
    capability_page_in,
    capability_refresh_bindings,
    capability_release_slot,
)
from capabilities.services.reaper import capability_reap
from capabilities.services.reconcile import capability_reconcile, runtime_provision, runtime_ready
from capabilities.services.registry import capability_deploy
from capabilities.services.removal import capability_expire_ephemerals, capability_remove, capability_remove_as_owner
from capabilities.services.rollbacks import capability_rollback, capability_rollback_by_agent
from capabilities.services.room import runtime_account_warning
from capabilities.services.splits import (
    SplitGuard,
    capability_promote,
    capability_split_abort,
    capability_split_guard,
    capability_split_set,
)
from capabilities.services.switching import (
    LeftBehind,
    SwitchEvent,
    SwitchPlan,
    SwitchStep,
    backend_switch,
    capability_adopt_backend,
    capability_switch_backend,
    runtime_failure,
    runtime_release_previous,
    runtime_sweep_previous,
    runtimes_left_behind,
    runtimes_still_holding,
    switch_plan,
    switch_target,
)
from capabilities.services.versions import DeployResult

__all__ = [
    "DeployResult",
    "EdgeStanding",
    "LeftBehind",
    "Published",
    "SplitGuard",
    "StillInFlight",
    "SwitchEvent",
    "SwitchPlan",
    "SwitchStep",
    "backend_switch",
    "binding_check_rename",
    "binding_delete",
    "binding_grant",
    "binding_revoke",
    "binding_save",
    "call_records_batch_keep",
    "call_records_push",
    "capability_adopt_backend",
    "capability_apply_stats",
    "capability_clear_slot",
    "capability_deploy",
    "capability_evict",
    "capability_expire_ephemerals",
    "capability_flush_stats",
    "capability_force_degraded",
    "capability_mark_inactive",
    "capability_mark_missing",
    "capability_page_in",
    "capability_page_out",
    "capability_place_version",
    "capability_prewarm",
    "capability_promote",
    "capability_prune_stats",
    "capability_reap",
    "capability_reconcile",
    "capability_record_breaker",
    "capability_refresh_bindings",
    "capability_release_slot",
    "capability_remove",
    "capability_remove_as_owner",
    "capability_reset_breaker",
    "capability_rollback",
    "capability_rollback_by_agent",
    "capability_set_cpu_limit",
    "capability_set_public",
    "capability_shed_excess",
    "capability_split_abort",
    "capability_split_guard",
    "capability_split_set",
    "capability_switch_backend",
    "edge_provision",
    "edge_publish",
    "edge_reconcile",
    "edge_standing",
    "edge_warning",
    "runtime_account_warning",
    "runtime_failure",
    "runtime_provision",
    "runtime_ready",
    "runtime_release_previous",
    "runtime_sweep_previous",
    "runtimes_left_behind",
    "runtimes_still_holding",
    "switch_plan",
    "switch_target",
]
