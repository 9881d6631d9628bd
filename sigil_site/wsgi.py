"""WSGI entry point: the invoke gateway in front of Django.

Paths Sigil serves itself (`/_api/`, `/_health`, `/_status/`, `/admin/`, `/static/`, ...)
go to Django; every other path is a capability call and goes straight to the gateway.
"""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sigil_site.settings")

django_application = get_wsgi_application()

from capabilities.gateway import Gateway  # noqa: E402  (needs Django set up first)

# Agent names start with a letter and exclude these, so the two never overlap.
DJANGO_PREFIXES = ("/_", "/admin/", "/admin", "/static/", "/metrics", "/favicon.ico")


class SigilApplication:
    def __init__(self, django_app) -> None:
        self.django_app = django_app
        self.gateway = None

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if path == "/" or path.startswith(DJANGO_PREFIXES):
            return self.django_app(environ, start_response)
        if self.gateway is None:
            # Built on first use, after the server has forked its workers, so each worker
            # owns its connection pools.
            self.gateway = Gateway()
        return self.gateway(environ, start_response)


application = SigilApplication(django_application)
