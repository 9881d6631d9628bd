"""Scope permissions: `deploy` may do everything `invoke` may."""

from __future__ import annotations

from rest_framework.permissions import BasePermission

from agents.tokens import Principal


class HasInvokeScope(BasePermission):
    message = "this call needs a token"

    def has_permission(self, request, view) -> bool:
        return isinstance(request.user, Principal)


class HasDeployScope(BasePermission):
    message = "this call needs a token with the deploy scope"

    def has_permission(self, request, view) -> bool:
        return isinstance(request.user, Principal) and request.user.can_deploy


class IsOwner(BasePermission):
    """The owner: SIGIL_OWNER_API_TOKEN, or a staff account's admin session. Agents' tokens
    are refused."""

    message = "this call is the owner's: send SIGIL_OWNER_API_TOKEN, or sign in to the admin"

    def has_permission(self, request, view) -> bool:
        return not isinstance(request.user, Principal) and bool(getattr(request.user, "is_staff", False))
