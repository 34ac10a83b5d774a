"""Team changes people ask for: API tokens and memberships; each audited.

The dashboard calls these, and so can the API or a command: nothing here knows about views.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from apps.audit.record import Actor, record
from apps.teams import access, labels
from apps.teams.models import ApiToken, Membership, Role, Scope, Team
from apps.teams.signals import token_revoked


class TeamChangeError(ValueError):
    """The change cannot be made (unknown user, last admin, bad scopes); the message says why."""


def _token_view(token: ApiToken) -> dict:
    return {"name": token.name, "prefix": token.prefix, "scopes": token.scopes}


def issue_token(
    team: Team, scopes: list[str], actor: Actor, *, name: str = ""
) -> tuple[ApiToken, str]:
    """Create a token and return it with its raw value, shown once and never stored."""
    wanted = sorted(set(scopes))
    if not wanted or set(wanted) - set(Scope.values):
        raise TeamChangeError("Choose the worker and/or manage scope.")
    if labels.unreadable(name):  # shown in the team's list and its audit trail
        raise TeamChangeError(f"Name: {labels.UNREADABLE}")
    with transaction.atomic():
        _lock_members(team, actor)
        token, raw = ApiToken.issue(team, wanted, name=name.strip()[:100], created_by=actor.user)
        record(
            actor,
            "token.create",
            team=team,
            target_type="token",
            target=token.prefix,
            after=_token_view(token),
        )
    return token, raw


def revoke_token(token: ApiToken, actor: Actor) -> bool:
    """Revoke a token; return False when it was already revoked.

    The process that revokes it stops accepting it at once (`token_revoked`, once committed);
    the others when their cache of it expires (apps/api/auth.py, CACHE_SECONDS).
    """
    with transaction.atomic():
        _lock_members(token.team, actor)
        changed = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        if changed:
            transaction.on_commit(lambda: token_revoked.send(ApiToken, token=token))
            record(
                actor,
                "token.revoke",
                team=token.team,
                target_type="token",
                target=token.prefix,
                before={**_token_view(token), "revoked": False},
                after={**_token_view(token), "revoked": True},
            )
    return bool(changed)


def _other_admins(team: Team, user) -> bool:
    """Whether the team has an admin besides `user` who can sign in: a deactivated account
    counted, and the team was left to it, with no one to manage it."""
    return (
        Membership.objects.filter(team=team, role=Role.ADMIN, user__is_active=True)
        .exclude(user=user)
        .exists()
    )


def _lock_members(team: Team, actor: Actor) -> None:
    """Lock the team's row: its membership and tokens change one at a time, each counting the
    admins the one before left. Locking only the changed membership let two admins demote each
    other at once, each counting the other, and leave the team with none. Then the person
    asking must still be an admin: their request was let in before another's change (their
    demotion) committed."""
    Team.objects.select_for_update().filter(pk=team.pk).exists()
    if actor.user is not None:
        access.forget(actor.user)
        if not access.has_role(actor.user, team, Role.ADMIN):
            raise TeamChangeError("You are no longer an admin of this team.")


def set_member(team: Team, username: str, role: str, actor: Actor) -> Membership:
    """Add a user to the team or change their role."""
    if role not in Role.values:
        raise TeamChangeError(f"Unknown role '{role}'.")
    user = get_user_model().objects.filter(username=username.strip()).first()
    if user is None:
        raise TeamChangeError(f"No user named '{username.strip()}'.")
    with transaction.atomic():
        _lock_members(team, actor)
        existing = Membership.objects.filter(team=team, user=user).first()
        before = {"role": existing.role} if existing else None
        if existing and existing.role == role:
            return existing
        if existing and existing.role == Role.ADMIN and not _other_admins(team, user):
            raise TeamChangeError("A team keeps at least one admin.")
        membership, _ = Membership.objects.update_or_create(
            team=team, user=user, defaults={"role": role}
        )
        record(
            actor,
            "member.set",
            team=team,
            target_type="member",
            target=user.get_username(),
            before=before,
            after={"role": role},
        )
    return membership


def remove_member(membership: Membership, actor: Actor) -> None:
    with transaction.atomic():
        _lock_members(membership.team, actor)
        current = Membership.objects.filter(pk=membership.pk).first()
        if current is None:
            return  # removed meanwhile
        membership = current
        if membership.role == Role.ADMIN and not _other_admins(membership.team, membership.user):
            raise TeamChangeError("A team keeps at least one admin.")
        record(
            actor,
            "member.remove",
            team=membership.team,
            target_type="member",
            target=membership.user.get_username(),
            before={"role": membership.role},
        )
        membership.delete()
