from __future__ import annotations

from rest_framework import permissions


def missing_scope(token, scope: str | None) -> str | None:
    """Why this token may not call an endpoint needing `scope`; None when it may."""
    if scope is None or token.has_scope(scope):
        return None
    return f"This endpoint needs a token with the '{scope}' scope."


class HasScope(permissions.BasePermission):
    """A team token with the scope the view names in `required_scope`."""

    message = "This token lacks the scope this endpoint needs."

    def has_permission(self, request, view) -> bool:
        token = request.auth
        if token is None:
            return False
        refusal = missing_scope(token, getattr(view, "required_scope", None))
        if refusal is None:
            return True
        self.message = refusal
        return False
