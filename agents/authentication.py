"""DRF authentication by Sigil bearer token."""

from __future__ import annotations

from rest_framework.authentication import BaseAuthentication

from agents.selectors import parse_bearer, token_authenticate
from sigil_site.errors import WWW_AUTHENTICATE


class BearerTokenAuthentication(BaseAuthentication):
    """`Authorization: Bearer <token>`; request.user is the Principal, request.auth its scope."""

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION")
        if not header:
            return None  # anonymous: views that need a token answer 401
        principal = token_authenticate(parse_bearer(header))
        return principal, principal.scope

    def authenticate_header(self, request) -> str:
        return WWW_AUTHENTICATE
