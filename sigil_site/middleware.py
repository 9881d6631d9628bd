"""Sigil's own middleware."""

from __future__ import annotations

from sigil_site.errors import request_id_new

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
        request.request_id = request_id_new()
        response = self.get_response(request)
        response["X-Request-Id"] = request.request_id
        return response
