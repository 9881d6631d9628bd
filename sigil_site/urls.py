"""Sigil's URLs: the control API, health, schema and admin. The invoke gateway is not here:
it is mounted in front of Django by sigil_site/wsgi.py so that calls skip the middleware."""

from django.contrib import admin
from django.urls import path

handler404 = "sigil_site.errors.handler404"
handler500 = "sigil_site.errors.handler500"

urlpatterns = [
    path("admin/", admin.site.urls),
]
