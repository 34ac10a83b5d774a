"""Who may see and change what: the one authorisation layer of the dashboard and the API.

Roles rank viewer < operator < editor < admin (see `Membership.allows`). A user sees the teams
they are a member of; staff users see every team (as viewers where they hold no membership), and
superusers are admins of every team. An API token sees only its own team: as an editor with the
`manage` scope, as a viewer otherwise (its `worker` scope is checked by the API's permission).
Every dashboard view and API view asks here, never the models directly.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet

from apps.teams.models import ROLE_RANK, Membership, Role, Team

# Cached on the user object, which Django builds once per request.
_CACHE_ATTR = "_cronlease_team_roles"


def team_roles(user) -> dict[int, str]:
    """Return {team id: role} for every team the user may see."""
    cached = getattr(user, _CACHE_ATTR, None)
    if cached is not None:
        return cached
    roles: dict[int, str] = {}
    token = getattr(user, "token", None)
    if token is not None:
        roles = {token.team_id: (Role.EDITOR if token.has_scope("manage") else Role.VIEWER).value}
    elif user is not None and user.is_authenticated and user.is_active:
        roles = dict(Membership.objects.filter(user=user).values_list("team_id", "role"))
        if user.is_superuser:
            roles = dict.fromkeys(Team.objects.values_list("id", flat=True), Role.ADMIN.value)
        elif user.is_staff:
            for team_id in Team.objects.values_list("id", flat=True):
                roles.setdefault(team_id, Role.VIEWER.value)
    if user is not None:
        setattr(user, _CACHE_ATTR, roles)
    return roles


def forget(user) -> None:
    """Drop the cached roles (after a membership change in the same request)."""
    if hasattr(user, _CACHE_ATTR):
        delattr(user, _CACHE_ATTR)


def visible_team_ids(user) -> list[int]:
    return sorted(team_roles(user))


def visible_teams(user) -> QuerySet[Team]:
    return Team.objects.filter(id__in=visible_team_ids(user)).order_by("slug")


def role_in(user, team: Team | int) -> str | None:
    team_id = team if isinstance(team, int) else team.pk
    return team_roles(user).get(team_id)


def has_role(user, team: Team | int, role: str) -> bool:
    held = role_in(user, team)
    return held is not None and ROLE_RANK[Role(held)] >= ROLE_RANK[Role(role)]


def require_role(user, team: Team | int, role: str) -> None:
    """Raise PermissionDenied (a 403) unless the user holds `role` or better in the team."""
    if not has_role(user, team, role):
        raise PermissionDenied(f"This needs the {role} role in the team.")


def require_role_in_all(user, team_ids: Iterable[int], role: str) -> None:
    for team_id in set(team_ids):
        require_role(user, team_id, role)


def teams_with_role(user, role: str) -> list[Team]:
    """Teams where the user holds `role` or better (e.g. where they may create definitions)."""
    ids = [team_id for team_id in team_roles(user) if has_role(user, team_id, role)]
    return list(Team.objects.filter(id__in=ids).order_by("slug"))
