"""DRF authentication by Sigil bearer token."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication

from agents import tokens
from agents.selectors import parse_bearer, token_authenticate
from agents.throttle import FailedAuthThrottle
from sigil_site.errors import WWW_AUTHENTICATE, Unauthenticated
from sigil_site.redis_client import get_redis


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
        cached, failures = client.mget(tokens.cache_key(tokens.hash_secret(secret)), throttle.key(address))
        throttle.check(client, address, failures)
        try:
            principal = token_authenticate(secret, cached=cached)
        except Unauthenticated:
            throttle.failed(client, address)
            raise
        return principal, principal.scope

    def authenticate_header(self, request) -> str:
        return WWW_AUTHENTICATE


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
