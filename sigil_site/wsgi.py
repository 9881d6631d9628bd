"""WSGI entry point: the invoke gateway in front of Django."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sigil_site.settings")

application = get_wsgi_application()
