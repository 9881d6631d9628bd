"""The capabilities app's background jobs by name (sigil.work.Job): services send these, and
capabilities/tasks.py declares the tasks that run them, so that no service imports the tasks
module. Which queue each goes to is CELERY_TASK_ROUTES' (settings)."""

from sigil.work import Job

capability_place_version = Job("capabilities.capability_place_version")
capability_release_slot = Job("capabilities.capability_release_slot")
capability_clear_slot = Job("capabilities.capability_clear_slot")
capability_expire_ephemerals = Job("capabilities.capability_expire_ephemerals")
capability_flush_stats = Job("capabilities.capability_flush_stats")
capability_split_guard = Job("capabilities.capability_split_guard")
capability_record_breaker = Job("capabilities.capability_record_breaker")
capability_page_out = Job("capabilities.capability_page_out")
capability_reconcile = Job("capabilities.capability_reconcile")
capability_reap = Job("capabilities.capability_reap")
capability_mark_inactive = Job("capabilities.capability_mark_inactive")
capability_prewarm = Job("capabilities.capability_prewarm")
capability_prune_stats = Job("capabilities.capability_prune_stats")
capability_refresh_bindings = Job("capabilities.capability_refresh_bindings")
edge_publish = Job("capabilities.edge_publish")
edge_reconcile = Job("capabilities.edge_reconcile")

# How often a page-out checks again whether its victim's calls in flight have ended.
PAGE_OUT_RECHECK_SECONDS = 0.25
