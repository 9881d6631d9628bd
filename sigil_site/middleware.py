"""Sigil's own middleware."""

from __future__ import annotations

from django.http import HttpResponse

from sigil.request_id import current_request_id, new_request_id

# The owner's console runs only the admin's own script files (no inline script, no other
# origin), so injected markup cannot run code there. Inline styles stay allowed: Django's
# admin templates and Sigil's set style attributes, and a style cannot run code.
ADMIN_CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


class AdminContentSecurityPolicy:
    """Send ADMIN_CONTENT_SECURITY_POLICY with every page under /admin/."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if request.path_info.startswith("/admin/"):
            response.setdefault("Content-Security-Policy", ADMIN_CONTENT_SECURITY_POLICY)
        return response


class RequestId:
    """Give each request Django serves an id (`request.request_id`), sent back as
    `X-Request-Id` and quoted by handler500, as the engine does for calls."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        # sigil_site/asgi.py gave the request its id (and the log its context) already.
        request.request_id = current_request_id() or new_request_id()
        response = self.get_response(request)
        response["X-Request-Id"] = request.request_id
        return response


# Sigil's own routes that a page of any origin may use (docs/contract.md, "Browsers and CORS"). The
# credential is a bearer token the page must hold and send itself, never a cookie a browser
# adds on its own, so allowing every origin lends no one else's authority; the admin is not
# among them. Calls (the engine) and /_mcp are served before Django and answer for themselves.
CROSS_ORIGIN_PATHS = ("/_api/", "/_status/", "/_health", "/llms.txt")
CROSS_ORIGIN_METHODS = "GET, HEAD, POST, PUT, DELETE"
CROSS_ORIGIN_REQUEST_HEADERS = "Authorization, Content-Type"
CROSS_ORIGIN_EXPOSED_HEADERS = "Retry-After, WWW-Authenticate, X-Request-Id, Location"
CROSS_ORIGIN_MAX_AGE_SECONDS = 86400


class CrossOrigin:
    """Answer CORS preflights on CROSS_ORIGIN_PATHS with 204 (no token needed: a preflight
    never carries one), and let pages of any origin read those routes' answers."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        if "Origin" not in request.headers or not request.path_info.startswith(CROSS_ORIGIN_PATHS):
            return self.get_response(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            response = HttpResponse(status=204)
            del response["Content-Type"]  # no body
            response["Access-Control-Allow-Methods"] = CROSS_ORIGIN_METHODS
            response["Access-Control-Allow-Headers"] = CROSS_ORIGIN_REQUEST_HEADERS
            response["Access-Control-Max-Age"] = str(CROSS_ORIGIN_MAX_AGE_SECONDS)
        else:
            response = self.get_response(request)
            response["Access-Control-Expose-Headers"] = CROSS_ORIGIN_EXPOSED_HEADERS
        response["Access-Control-Allow-Origin"] = "*"
        return response
