"""The admin login's lock-out (django-axes, counted in Redis through Django's cache): the
page a locked-out address gets, and a handler that can lift every lock-out at once."""

from __future__ import annotations

from axes.handlers.cache import AxesCacheHandler
from axes.helpers import get_client_cache_keys
from django.conf import settings
from django.contrib import admin
from django.core.cache import cache
from django.http import HttpResponse
from django.shortcuts import render

from sigil.errors import retry_after_header
from sigil.redis_client import get_redis


class LockoutCacheHandler(AxesCacheHandler):
    """axes' cache handler, whose reset without a filter (`manage.py axes_reset`) clears every
    address's count instead of raising NotImplementedError: the count is one cache key per
    address, `axes-<sha256>`, found by its prefix."""

    def reset_attempts(self, *, ip_address=None, username=None, ip_or_username=False) -> int:
        if ip_address is not None or username is not None or ip_or_username:
            return super().reset_attempts(ip_address=ip_address, username=username, ip_or_username=ip_or_username)
        keys = list(get_redis().scan_iter(match=cache.make_key("axes-*"), count=1000))
        return get_redis().delete(*keys) if keys else 0


def lockout_response(request, original_response=None, credentials=None) -> HttpResponse:
    """AXES_LOCKOUT_CALLABLE: the admin's own page, saying for how long and what to do."""
    seconds_left = None
    for key in get_client_cache_keys(request, credentials):
        ttl = get_redis().ttl(cache.make_key(key))
        if ttl > 0:
            seconds_left = max(seconds_left or 0, ttl)
    context = {
        **admin.site.each_context(request),
        "title": "Sign-in locked",
        "failure_limit": settings.AXES_FAILURE_LIMIT,
        "lockout_minutes": max(1, round(settings.SIGIL_ADMIN_LOCKOUT_SECONDS / 60)),
        "minutes_left": None if seconds_left is None else max(1, -(-seconds_left // 60)),
    }
    # Rendered now: axes returns it from middleware, after which nothing renders a TemplateResponse.
    response = render(request, "admin/sigil/locked_out.html", context, status=429)
    # Each attempt meanwhile starts the lock-out again: its whole length is when to come back.
    response["Retry-After"] = retry_after_header(settings.SIGIL_ADMIN_LOCKOUT_SECONDS)
    return response
