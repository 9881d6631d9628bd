from django.urls import path

from capabilities import api

urlpatterns = [
    path("", api.index_view, name="index"),
    path("_api/deploy", api.CapabilityDeployApi.as_view(), name="capability-deploy"),
    path("_api/capabilities", api.CapabilityListApi.as_view(), name="capability-list"),
    path("_api/capabilities/<str:full>", api.CapabilityDetailApi.as_view(), name="capability-detail"),
    path("_api/capabilities/<str:full>/logs", api.CapabilityLogsApi.as_view(), name="capability-logs"),
    path("_api/capabilities/<str:full>/logs/tail", api.CapabilityLogsTailApi.as_view(), name="capability-logs-tail"),
    path("_api/capabilities/<str:full>/split", api.CapabilitySplitApi.as_view(), name="capability-split"),
    path(
        "_api/capabilities/<str:full>/split/promote",
        api.CapabilityPromoteApi.as_view(),
        name="capability-split-promote",
    ),
    path(
        "_api/capabilities/<str:full>/split/abort",
        api.CapabilitySplitAbortApi.as_view(),
        name="capability-split-abort",
    ),
    path("_api/capabilities/<str:full>/versions", api.CapabilityVersionsApi.as_view(), name="capability-versions"),
    path("_api/capabilities/<str:full>/rollback", api.CapabilityRollbackApi.as_view(), name="capability-rollback"),
    path("_api/agent/a2a", api.AgentA2aApi.as_view(), name="agent-a2a"),
    path("_api/calls/<str:call_id>", api.CallStatusApi.as_view(), name="call-status"),
    path("_api/cost", api.CostApi.as_view(), name="cost"),
    path("_api/status", api.StatusApi.as_view(), name="status"),
    path("_status/<str:full>", api.CapabilityWarmingStatusApi.as_view(), name="capability-warming-status"),
    path("_health", api.HealthApi.as_view(), name="health"),
    path("metrics", api.metrics_view, name="metrics"),
    path("llms.txt", api.llms_txt_view, name="llms-txt"),
]
