"""Writing the audit trail: `record`, and the relay of events kept with their rows in a shard
database (`kept_with_rows`, `relay`)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from typing import Any

from django.db import DatabaseError, connections, router, transaction
from django.utils import timezone

from apps.audit.models import AuditEvent, PendingEvent, Source

log = logging.getLogger(__name__)


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


# Inside `kept_with_rows`, the events kept in databases other than the trail's whose
# transactions have committed, by database, as the trail's relayed rows take them.
_kept: ContextVar[dict[str, list[list[Any]]] | None] = ContextVar(
    "audit_kept_with_rows", default=None
)

INSERT_PENDING = """
INSERT INTO audit_pendingevent (id, created_at, team_id, actor_user_id, actor_token_id, actor,
                                source, action, target_type, target, before, after)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)
"""
# The relay, on the database that keeps them: the oldest pending events, locked (SKIP LOCKED:
# two relays share the work), inserted into the trail once each (audit_relayed_once), then
# deleted. The trail commits first: a relay that fails before the delete commits repeats
# them, and the trail keeps one of each.
TAKE_PENDING = """
SELECT id, created_at, team_id, actor_user_id, actor_token_id, actor, source, action,
       target_type, target, before::text, after::text
FROM audit_pendingevent ORDER BY created_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED
"""
# A team, user or token deleted since is null, as the trail's own foreign keys leave it (the
# tables they refer to are read from the model: `_relayed_row`).
INSERT_RELAYED = """
INSERT INTO audit_auditevent (relayed_from, created_at, team_id, actor_user_id, actor_token_id,
                              actor, source, action, target_type, target, before, after)
VALUES {rows}
ON CONFLICT (relayed_from) WHERE relayed_from IS NOT NULL DO NOTHING
"""
RELAYED_ROW = """
(%s, %s, (SELECT id FROM {team} WHERE id = %s), (SELECT id FROM {actor_user} WHERE id = %s),
 (SELECT id FROM {actor_token} WHERE id = %s), %s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)"""
DELETE_PENDING = "DELETE FROM audit_pendingevent WHERE id = ANY(%(ids)s::uuid[])"


@contextmanager
def kept_with_rows() -> Iterator[None]:
    """Inside the block, an event is written to the database current for the sharded models
    (the one whose rows it is about: `PendingEvent` is routed as they are) when that is not the
    trail's own, in its transaction; once that transaction has committed and the caller's on
    the trail's database too (at once when there is none), the event is copied to the trail and
    deleted where it was kept (`relay_kept`). A copy that fails leaves them for the scheduler's
    relay (`relay`). Nested blocks relay with the outermost."""
    if _kept.get() is not None:
        yield
        return
    kept: dict[str, list[list[Any]]] = {}
    token = _kept.set(kept)
    try:
        yield
    finally:
        _kept.reset(token)
        # Also when the block failed: a database that committed before the failure keeps the
        # events of its rows.
        trail = router.db_for_write(AuditEvent)
        for database, rows in sorted(kept.items()):
            transaction.on_commit(lambda db=database, r=rows: relay_kept(db, r), using=trail)


def relay_kept(database: str, rows: list[list[Any]]) -> None:
    """Copy events just kept in `database` (its transaction committed) to the trail, then delete
    them there: two statements, where the scheduler's `relay` locks and reads them first (one
    run enqueued in-process with shards on servers of their own: 4.2 ms against 4.8 ms). Each
    lands once (`audit_relayed_once`), whoever copies it first; a failure leaves them for the
    scheduler's relay."""
    try:
        copy_to_trail(rows)
        with connections[database].cursor() as cursor:
            cursor.execute(DELETE_PENDING, {"ids": [row[0] for row in rows]})
    except DatabaseError as exc:
        log.warning(
            "audit events kept in %s are left for the scheduler to relay: %s",
            database, type(exc).__name__,
        )  # fmt: skip
        # A connection the failure left dead is not handed to the rest of the request: the
        # answer of the change that did commit read the clock on it, and was a 503.
        for alias in (router.db_for_write(AuditEvent), database):
            if not connections[alias].in_atomic_block:
                connections[alias].close_if_unusable_or_obsolete()


def relay(database: str, batch: int = 1000) -> int:
    """Move up to `batch` pending events kept in `database` to the trail; return how many."""
    with transaction.atomic(using=database), connections[database].cursor() as cursor:
        cursor.execute(TAKE_PENDING, {"batch": batch})
        rows = cursor.fetchall()
        if not rows:
            return 0
        copy_to_trail(rows)
        cursor.execute(DELETE_PENDING, {"ids": [row[0] for row in rows]})
    return len(rows)


def copy_to_trail(rows: Sequence[Sequence[Any]]) -> None:
    """Insert kept events (as TAKE_PENDING reads them) into the trail, those not there yet, in
    one statement (psycopg's executemany runs a pipeline, which a statement failing at its
    commit left unusable for the next query)."""
    with connections[router.db_for_write(AuditEvent)].cursor() as cursor:
        # At most 1 000 a statement: a statement takes 65 535 parameters, 12 an event.
        for start in range(0, len(rows), 1000):
            part = rows[start : start + 1000]
            sql = INSERT_RELAYED.format(rows=",".join([_relayed_row()] * len(part)))
            cursor.execute(sql, [value for row in part for value in row])


@cache
def _relayed_row() -> str:
    tables = {
        field: AuditEvent._meta.get_field(field).related_model._meta.db_table
        for field in ("team", "actor_user", "actor_token")
    }
    return RELAYED_ROW.format(**tables)


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
    values = [
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
    ]
    database = router.db_for_write(AuditEvent)
    kept = _kept.get()
    if kept is not None and (rows := router.db_for_write(PendingEvent)) != database:
        event.relayed_from = uuid.uuid4()
        row = [event.relayed_from, *values]
        with connections[rows].cursor() as cursor:
            cursor.execute(INSERT_PENDING, row)
        # Relayed only if its transaction commits (at once outside one).
        transaction.on_commit(lambda: kept.setdefault(rows, []).append(row), using=rows)
        return event  # not in the trail yet: no id
    with connections[database].cursor() as cursor:
        cursor.execute(INSERT_EVENT, values)
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
