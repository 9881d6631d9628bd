"""Sigil's own middleware."""

from __future__ import annotations

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
