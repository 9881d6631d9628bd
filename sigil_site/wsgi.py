"""WSGI entry point: the invoke gateway in front of Django.

Paths Sigil serves itself (`/_api/`, `/_health`, `/_status/`, `/admin/`, `/static/`, ...)
go to Django; every other path is a capability call and goes straight to the gateway.
"""

import io
import os

from django.conf import settings
from django.core.wsgi import get_wsgi_application

from sigil_site.request_id import new_request_id, set_request_id

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sigil_site.settings")

django_application = get_wsgi_application()

from capabilities.gateway import Gateway  # noqa: E402  (needs Django set up first)
from capabilities.mcp.endpoint import McpEndpoint  # noqa: E402

MCP_PATH = "/_mcp"

# Agent names start with a letter and exclude these, so the two never overlap.
DJANGO_PREFIXES = ("/_", "/admin/", "/admin", "/static/", "/metrics", "/favicon.ico", "/llms.txt")


class SigilApplication:
    def __init__(self, django_app) -> None:
        self.django_app = django_app
        self.gateway = None
        # MCP tool calls go through this same gateway, in-process.
        self.mcp = McpEndpoint(gateway=self.get_gateway)

    def __call__(self, environ, start_response):
        # Every line logged while serving this request names it (sigil_site/logs.py). Left
        # set afterwards: the gateway writes its access line when the response is closed.
        environ["sigil.request_id"] = request_id = new_request_id()
        set_request_id(request_id)
        path = environ.get("PATH_INFO", "/")
        if path == MCP_PATH:
            return self.mcp(environ, start_response)
        if path == "/" or path.startswith(DJANGO_PREFIXES):
            if not environ.get("CONTENT_LENGTH") and "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
                buffer_chunked_body(environ)
            return self.django_app(environ, start_response)
        return self.get_gateway()(environ, start_response)

    def get_gateway(self) -> Gateway:
        if self.gateway is None:
            # Built on first use, after the server has forked its workers, so each worker
            # owns its connection pools.
            self.gateway = Gateway()
        return self.gateway


def buffer_chunked_body(environ) -> None:
    """Give Django a chunked body (decoded by the server) with its length.

    Django reads a body by its Content-Length only, so a chunked deploy would look empty.
    The body is read up to the deploy limit and one byte more, so that an oversized one is
    still refused as a 413 by the API's own check.
    """
    body = environ["wsgi.input"].read(settings.SIGIL_DEPLOY_MAX_BODY_BYTES + 1)
    environ["wsgi.input"] = io.BytesIO(body)
    environ["CONTENT_LENGTH"] = str(len(body))


application = SigilApplication(django_application)

from capabilities.services import runtime_ready  # noqa: E402

# A web process serves capabilities: Sigil's own Worker (and its namespace) must exist before
# the first call, not after a first deploy. Done while the server loads the application, so
# it answers ready; a failure is logged and /_health reports it.
runtime_ready(actor="system")
