"""The one function that writes the audit trail."""

from __future__ import annotations

from collections.abc import Sequence
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


# An event about many objects names at most this many of them, and counts the rest: a batch
# naming another team's run a thousand times writes one event, not a thousand.
TARGETS_SHOWN = 20


def record_denied(
    actor: Actor,
    attempted: str,
    *,
    team: Any,
    target_type: str,
    target: str | Sequence[str],
    count: int | None = None,
) -> AuditEvent:
    """Record an attempt on another team's objects (answered as if they did not exist): one
    event per request and team, however many of the team's objects it named."""
    targets = [target] if isinstance(target, str) else list(dict.fromkeys(target))
    after: dict[str, Any] = {"attempted": attempted}
    if len(targets) > 1 or (count or 1) > 1:
        after["count"] = count if count is not None else len(targets)
        after["targets"] = targets[:TARGETS_SHOWN]
    return record(
        actor,
        "access.denied",
        team=team,
        target_type=target_type,
        target=targets[0] if len(targets) == 1 else f"{len(targets)} {target_type}s",
        after=after,
    )
