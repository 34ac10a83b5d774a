from __future__ import annotations

from rest_framework import permissions


def missing_scope(token, scope: str | None, also: tuple[str, ...] = ()) -> str | None:
    """Why this token may not call an endpoint needing `scope` (or one of `also`); None when it
    may."""
    if scope is None or any(token.has_scope(each) for each in (scope, *also)):
        return None
    named = " or ".join(f"'{each}'" for each in (scope, *also))
    return f"This endpoint needs a token with the {named} scope."


class HasScope(permissions.BasePermission):
    """A team token with the scope the view names in `required_scope`, or one of those in its
    `also_for_scopes`."""

    message = "This token lacks the scope this endpoint needs."

    def has_permission(self, request, view) -> bool:
        token = request.auth
        if token is None:
            return False
        refusal = missing_scope(
            token, getattr(view, "required_scope", None), getattr(view, "also_for_scopes", ())
        )
        if refusal is None:
            return True
        self.message = refusal
        return False
