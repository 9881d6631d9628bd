"""The admin login's lock-out (django-axes, counted in Redis through Django's cache): the
page a locked-out address gets, a handler that can lift every lock-out at once, and trusted
devices.

A lock-out keyed by address alone lets anyone on the owner's address (a tenant on the same
host, every client behind the same proxy) lock the owner out with five wrong guesses. A
browser that signed in successfully therefore gets a signed device cookie (OWASP's "device
cookies", in the Authentication Cheat Sheet): a login attempt that carries a valid one for
the user it names is counted as that device, under a failure count of its own, so the
address's lock-out does not apply to it, and guesses made with a stolen cookie still lock
that cookie out after as many failures.
"""

from __future__ import annotations

import secrets

from axes.handlers.cache import AxesCacheHandler
from axes.helpers import get_client_cache_keys
from django.conf import settings
from django.contrib import admin
from django.contrib.auth.signals import user_logged_in
from django.core import signing
from django.core.cache import cache
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

from agents.throttle import request_client_address
from sigil.errors import retry_after_header
from sigil.redis_client import get_redis

DEVICE_COOKIE = "sigil_device"
_DEVICE_SALT = "sigil.admin.trusted-device"


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
        "from_device": admin_login_client(request).startswith("device:"),
        "trusted_device_days": settings.SIGIL_ADMIN_TRUSTED_DEVICE_DAYS,
    }
    # Rendered now: axes returns it from middleware, after which nothing renders a TemplateResponse.
    response = render(request, "admin/sigil/locked_out.html", context, status=429)
    # Each attempt meanwhile starts the lock-out again: its whole length is when to come back.
    response["Retry-After"] = retry_after_header(settings.SIGIL_ADMIN_LOCKOUT_SECONDS)
    return response


def trusted_device(request: HttpRequest, username: str) -> str | None:
    """The id of the trusted device `request` comes from for `username`: its device cookie is
    Sigil's signature, younger than SIGIL_ADMIN_TRUSTED_DEVICE_DAYS, and issued to that user.
    None otherwise (no cookie, forged, expired, another user's, or trusted devices off)."""
    value = request.COOKIES.get(DEVICE_COOKIE)
    if not value or not username or settings.SIGIL_ADMIN_TRUSTED_DEVICE_DAYS <= 0:
        return None
    try:
        device = signing.loads(value, salt=_DEVICE_SALT, max_age=settings.SIGIL_ADMIN_TRUSTED_DEVICE_DAYS * 86400)
    except signing.BadSignature:
        return None
    if not isinstance(device, dict) or device.get("user") != username or not isinstance(device.get("id"), str):
        return None
    return device["id"]


def admin_login_client(request: HttpRequest) -> str:
    """AXES_CLIENT_IP_CALLABLE: who an admin login attempt is counted against. A trusted
    device for the user it names is counted as itself (`device:<id>`), apart from its
    address; any other attempt, as its client address."""
    device = trusted_device(request, request.POST.get("username", "") if request.method == "POST" else "")
    return f"device:{device}" if device else request_client_address(request)


def trust_device(request: HttpRequest, response: HttpResponse, username: str) -> None:
    """Give the browser that just signed in as `username` a new device cookie (a new id each
    time, so a device's failure count starts again with each success)."""
    if settings.SIGIL_ADMIN_TRUSTED_DEVICE_DAYS <= 0:
        return
    value = signing.dumps({"user": username, "id": secrets.token_urlsafe(16)}, salt=_DEVICE_SALT)
    response.set_cookie(
        DEVICE_COOKIE,
        value,
        max_age=settings.SIGIL_ADMIN_TRUSTED_DEVICE_DAYS * 86400,
        path="/admin/",
        secure=request.is_secure(),
        httponly=True,
        samesite="Lax",
    )


class TrustedDevice:
    """Middleware: the admin login that signs a browser in gives it a device cookie."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        signed_in = getattr(request, _SIGNED_IN, None)
        if signed_in is not None and request.path == reverse("admin:login"):
            trust_device(request, response, signed_in)
        return response


_SIGNED_IN = "sigil_signed_in_as"


@receiver(user_logged_in, dispatch_uid="sigil_site.lockout.signed_in")
def _note_sign_in(sender, request, user, **kwargs) -> None:
    """Note on the request who just signed in (Django's own signal of a successful login,
    whether or not the browser was signed in already), for TrustedDevice."""
    if request is not None:
        setattr(request, _SIGNED_IN, user.get_username())
