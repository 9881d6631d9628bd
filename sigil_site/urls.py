"""Sigil's URLs: the control API, health, schema and admin. The invoke gateway is not here:
sigil_site/wsgi.py mounts it in front of Django so that calls skip the middleware."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

handler404 = "sigil_site.errors.handler404"
handler500 = "sigil_site.errors.handler500"

urlpatterns = [
    path("", include("capabilities.urls")),
    path("_api/schema", SpectacularAPIView.as_view(), name="schema"),
    path("_api/schema/docs", SpectacularSwaggerView.as_view(url_name="schema"), name="schema-docs"),
    path("admin/", admin.site.urls),
]
