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
