from django.urls import path

from capabilities.api import deploy, discover, operate, records
from capabilities.record_pushes import PUSH_PATH

CAPABILITY = "_api/capabilities/<str:full>"

urlpatterns = [
    path("", operate.index_view, name="index"),
    path("_api/deploy", deploy.CapabilityDeployApi.as_view(), name="capability-deploy"),
    path("_api/capabilities", discover.CapabilityListApi.as_view(), name="capability-list"),
    path(CAPABILITY, discover.CapabilityDetailApi.as_view(), name="capability-detail"),
    path(f"{CAPABILITY}/logs", discover.CapabilityLogsApi.as_view(), name="capability-logs"),
    path(f"{CAPABILITY}/logs/tail", discover.CapabilityLogsTailApi.as_view(), name="capability-logs-tail"),
    path(f"{CAPABILITY}/split", deploy.CapabilitySplitApi.as_view(), name="capability-split"),
    path(f"{CAPABILITY}/split/promote", deploy.CapabilityPromoteApi.as_view(), name="capability-split-promote"),
    path(f"{CAPABILITY}/split/abort", deploy.CapabilitySplitAbortApi.as_view(), name="capability-split-abort"),
    path(f"{CAPABILITY}/versions", deploy.CapabilityVersionsApi.as_view(), name="capability-versions"),
    path(f"{CAPABILITY}/rollback", deploy.CapabilityRollbackApi.as_view(), name="capability-rollback"),
    path("_api/agent/a2a", deploy.AgentA2aApi.as_view(), name="agent-a2a"),
    path("_api/agent/webhook", deploy.AgentWebhookApi.as_view(), name="agent-webhook"),
    path("_api/calls/<str:call_id>", discover.CallStatusApi.as_view(), name="call-status"),
    path("_api/cost", operate.CostApi.as_view(), name="cost"),
    path("_api/status", operate.StatusApi.as_view(), name="status"),
    path("_status/<str:full>", discover.CapabilityWarmingStatusApi.as_view(), name="capability-warming-status"),
    path("_health", operate.HealthApi.as_view(), name="health"),
    path(PUSH_PATH, records.call_records_push_view, name="call-records-push"),
    path("metrics", operate.metrics_view, name="metrics"),
    path("llms.txt", operate.llms_txt_view, name="llms-txt"),
]
