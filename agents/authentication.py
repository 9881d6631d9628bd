"""DRF authentication by Sigil bearer token."""

from __future__ import annotations

import hmac

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, SessionAuthentication

from agents import tokens
from agents.selectors import parse_bearer
from agents.throttle import FailedAuthThrottle
from sigil import redis_keys
from sigil.errors import WWW_AUTHENTICATE
from sigil.redis_client import get_redis


class BearerTokenAuthentication(BaseAuthentication):
    """`Authorization: Bearer <token>`; request.user is the Principal, request.auth its scope.

    A client address with too many failed tokens is refused (agents.throttle); its count is
    read in the same round trip as the token.
    """

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION")
        if not header:
            return None  # anonymous: views that need a token answer 401
        secret = parse_bearer(header)
        throttle = FailedAuthThrottle.from_settings()
        address = throttle.address(request.META)
        client = get_redis()
        cached, failures = client.mget(redis_keys.token(tokens.hash_secret(secret)), throttle.key(address))
        principal = throttle.authenticate(client, address, secret, cached=cached, failures=failures)
        return principal, principal.scope

    def authenticate_header(self, request) -> str:
        return WWW_AUTHENTICATE


class Owner:
    """The owner, authenticated by SIGIL_OWNER_API_TOKEN rather than an admin session."""

    is_authenticated = True
    is_staff = True

    def __str__(self) -> str:
        return "owner"


class OwnerTokenAuthentication(BaseAuthentication):
    """`Authorization: Bearer <SIGIL_OWNER_API_TOKEN>` for the owner's API calls; any other
    token is left to the next class (an agent's token, or a 401)."""

    def authenticate(self, request):
        expected = settings.SIGIL_OWNER_API_TOKEN
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not expected or not hmac.compare_digest(header.encode(), f"Bearer {expected}".encode()):
            return None
        return Owner(), "owner"

    def authenticate_header(self, request) -> str:
        return WWW_AUTHENTICATE


class StaffSessionAuthentication(SessionAuthentication):
    """The admin's session of a staff account (CSRF checked on writes, as DRF does)."""

    def authenticate(self, request):
        found = super().authenticate(request)
        if found is None or not found[0].is_staff:
            return None
        return found


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """The schema's security scheme for BearerTokenAuthentication (drf-spectacular)."""

    target_class = BearerTokenAuthentication
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An agent's deploy or invoke token, as issued by the owner",
        }


class OwnerTokenScheme(OpenApiAuthenticationExtension):
    target_class = OwnerTokenAuthentication
    name = "ownerBearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "SIGIL_OWNER_API_TOKEN, the owner's own token"}


class StaffSessionScheme(OpenApiAuthenticationExtension):
    target_class = StaffSessionAuthentication
    name = "adminSession"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "cookie", "name": "sessionid", "description": "A staff account's admin session"}
