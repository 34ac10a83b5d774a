from __future__ import annotations

from rest_framework import permissions


class HasScope(permissions.BasePermission):
    """A team token with the scope the view names in `required_scope`."""

    message = "This token lacks the scope this endpoint needs."

    def has_permission(self, request, view) -> bool:
        token = request.auth
        if token is None:
            return False
        scope = getattr(view, "required_scope", None)
        if scope is None or token.has_scope(scope):
            return True
        self.message = f"This endpoint needs a token with the '{scope}' scope."
        return False
