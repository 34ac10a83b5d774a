"""The one function that writes the audit trail."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections, router
from django.utils import timezone

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


# One row, written by hand: the ORM's save compiled this same INSERT on every call, ~0.4 ms of
# the ~3.8 ms of CPU a one-run POST /api/v1/runs cost the web process (in-process, Django's
# test client). The values as the model's fields would write them: `created_at` as auto_now_add
# sets it, `before` and `after` as JSONField encodes them.
INSERT_EVENT = """
INSERT INTO audit_auditevent (created_at, team_id, actor_user_id, actor_token_id, actor, source,
                              action, target_type, target, before, after)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)
RETURNING id
"""


def _fitted(text: str, field: str) -> str:
    """`text` cut to the column's width, marked when cut: a sign-in with a name of 10 000
    characters is audited as that name's start, not refused by the database (a 500)."""
    width = AuditEvent._meta.get_field(field).max_length
    return text if len(text) <= width else text[: width - 1] + "…"


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
    event = AuditEvent(
        created_at=timezone.now(),
        team=team,
        actor_user=actor.user,
        actor_token=actor.token,
        actor=_fitted(actor.label, "actor"),
        source=actor.source,
        action=action,
        target_type=target_type,
        target=_fitted(target, "target"),
        before=before,
        after=after,
    )
    database = router.db_for_write(AuditEvent)
    with connections[database].cursor() as cursor:
        cursor.execute(
            INSERT_EVENT,
            [
                event.created_at,
                event.team_id,
                event.actor_user_id,
                event.actor_token_id,
                event.actor,
                event.source,
                event.action,
                event.target_type,
                event.target,
                None if before is None else json.dumps(before),
                None if after is None else json.dumps(after),
            ],
        )
        event.pk = cursor.fetchone()[0]
    event._state.adding = False
    event._state.db = database
    return event


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
