"""The one function that writes the audit trail."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apps.audit.models import AuditEvent, Source


@dataclass(frozen=True)
class Actor:
    """Who did something: a signed-in user, an API token, or the system itself."""

    label: str
    source: str
    user: Any = None
    token: Any = None

    @classmethod
    def system(cls, label: str = "system") -> Actor:
        return cls(label=label, source=Source.SYSTEM)

    @classmethod
    def cli(cls, label: str = "cli") -> Actor:
        return cls(label=label, source=Source.CLI)

    @classmethod
    def for_token(cls, token: Any) -> Actor:
        return cls(label=f"token:{token.prefix}", source=Source.API, token=token)

    @classmethod
    def for_user(cls, user: Any) -> Actor:
        return cls(label=user.get_username(), source=Source.DASHBOARD, user=user)


def record(
    actor: Actor,
    action: str,
    *,
    team: Any,
    target_type: str,
    target: str,
    before: Any = None,
    after: Any = None,
) -> AuditEvent:
    return AuditEvent.objects.create(
        team=team,
        actor_user=actor.user,
        actor_token=actor.token,
        actor=actor.label,
        source=actor.source,
        action=action,
        target_type=target_type,
        target=target,
        before=before,
        after=after,
    )


def record_denied(
    actor: Actor, attempted: str, *, team: Any, target_type: str, target: str
) -> AuditEvent:
    """Record an attempt on another team's object (answered as if the object did not exist)."""
    return record(
        actor,
        "access.denied",
        team=team,
        target_type=target_type,
        target=target,
        after={"attempted": attempted},
    )
