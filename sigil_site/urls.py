"""Sigil's URLs: the control API, health, schema and admin. The engine, which serves the
capability calls, is not here: sigil_site/asgi.py mounts it in front of Django so that calls
skip the middleware."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from sigil_site import admin as owner_pages

handler404 = "sigil.errors.handler404"
handler500 = "sigil.errors.handler500"

urlpatterns = [
    path("", include("capabilities.urls")),
    path("_api/schema", SpectacularAPIView.as_view(), name="schema"),
    path("_api/schema/docs", SpectacularSwaggerView.as_view(url_name="schema"), name="schema-docs"),
    # The owner's own pages, behind the admin's staff check (admin_view), before its catch-all.
    path("admin/dashboard/", admin.site.admin_view(owner_pages.dashboard_view), name="sigil-dashboard"),
    path("admin/beat-schedule/", admin.site.admin_view(owner_pages.beat_schedule_view), name="sigil-beat-schedule"),
    path("admin/", admin.site.urls),
]
