"""Sigil's own middleware."""

from __future__ import annotations

from sigil_site.request_id import current_request_id, new_request_id

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
    `X-Request-Id` and quoted by handler500, as the gateway does for calls."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        # sigil_site/wsgi.py gave the request its id (and the log its context) already.
        request.request_id = current_request_id() or new_request_id()
        response = self.get_response(request)
        response["X-Request-Id"] = request.request_id
        return response
