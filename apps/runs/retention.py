"""Retention: finished runs (and their attempts and payload blobs) leave after their team's
retention, the audit trail after its own, the rows of workers idle for a day (the workers list),
in small batches that hold no lock for long; blobs the storage failed to delete are tried again,
and audit events a request kept on a shard database and could not relay are relayed.

Dead runs stay until someone handles them (requeue or discard), whatever their age.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, connections, transaction

from apps.audit.record import relay
from apps.runs import counters, payloads, shards, workers

log = logging.getLogger(__name__)

# One batch of one team: its oldest finished runs past the cutoff. The run_team_state index
# (team_id, state, id DESC) is read backwards from the oldest id, so the scan stops after
# `batch` matches. SKIP LOCKED: a run a worker or person is touching right now waits for the
# next batch. Attempts go in the same statement: a run held so is not being leased.
DELETE_FINISHED = """
WITH doomed AS (
    SELECT id FROM runs_run
    WHERE team_id = %(team)s AND state = ANY(%(states)s::text[])
      AND finished_at < now() - make_interval(days => %(days)s)
    ORDER BY id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), attempts AS (
    DELETE FROM runs_attempt WHERE run_id IN (SELECT id FROM doomed)
)
DELETE FROM runs_run WHERE id IN (SELECT id FROM doomed)
RETURNING payload_key
"""

# All runs of one definition, a batch at a time (deleting the definition). Served by
# run_definition_recent (definition_id, id DESC). A run being leased meanwhile is deleted once
# the claim commits, and its new attempt is seen only by a later statement: the attempts go
# in one of their own (attempt_run_number), and none is left without its run.
DELETE_OF_DEFINITION = """
DELETE FROM runs_run
WHERE id IN (SELECT id FROM runs_run WHERE definition_id = %(definition)s LIMIT %(batch)s)
RETURNING id, payload_key
"""
DELETE_ATTEMPTS = "DELETE FROM runs_attempt WHERE run_id = ANY(%(runs)s::bigint[])"

# A definition's cron runs that the materialiser made ahead of their time and nobody has
# claimed (never leased: no attempt), when its schedule changes: the new schedule makes its
# own (its next fire time is computed afresh), and these would otherwise run after an endAt,
# before a startAt, or past a `skip`. Served by run_definition_due_unique (definition_id,
# due_at) of scheduled triggers, from now on: a range of at most the lookahead's fire times. A
# run being leased meanwhile is no longer waiting once its claim commits, and stays.
DELETE_MADE_AHEAD = """
DELETE FROM runs_run
WHERE definition_id = %(definition)s AND due_at > now() AND trigger IN ('cron', 'catch_up')
  AND state IN ('scheduled', 'ready') AND attempt = 0
RETURNING payload_key, due_at
"""

DELETE_AUDIT = """
DELETE FROM audit_auditevent
WHERE id IN (
    SELECT id FROM audit_auditevent
    WHERE created_at < now() - make_interval(days => %(days)s)
    ORDER BY created_at LIMIT %(batch)s
)
"""

RETAINED_STATES = ["succeeded", "cancelled"]


def delete_one_batch(team_id: int, days: int, batch: int) -> int:
    """Delete up to `batch` of the team's finished runs older than `days` from the current
    shard database; return how many."""
    with transaction.atomic(using=shards.current()), shards.cursor() as cursor:
        cursor.execute(
            DELETE_FINISHED,
            {"team": team_id, "states": RETAINED_STATES, "days": days, "batch": batch},
        )
        keys = [row[0] for row in cursor.fetchall()]
    payloads.delete_unreferenced(keys)
    return len(keys)


def _delete_isolating(team_id: int, days: int, batch: int) -> int:
    """`delete_one_batch`, with an error of the team's own logged and passed over (0 deleted):
    raised, it stopped the round, and so the retention of every other team, of the audit trail,
    idle workers and stranded payloads, at every round. A database that is down (or a lock
    waited on past its bound) is no team's error: it is raised, for the round's caller."""
    try:
        return delete_one_batch(team_id, days, batch)
    except shards.DOWN:
        raise
    except DatabaseError:
        log.exception(
            "retention of team %s on shards %s failed; passed over until the next round",
            team_id,
            shards.span(shards.current()),
        )
        return 0


def delete_made_ahead(definition_id: int) -> list[str]:
    """Delete the definition's unclaimed cron runs still ahead of their time from the current
    shard database, inside the caller's transaction; return their payload keys (for
    `payloads.delete_unreferenced` once it commits). At most the materialiser's lookahead of
    fire times."""
    return made_ahead_deleted(definition_id)[0]


def made_ahead_deleted(definition_id: int) -> tuple[list[str], datetime | None]:
    """`delete_made_ahead`, with the first fire time deleted (None: none was): to make them
    again from there."""
    with shards.cursor() as cursor:
        cursor.execute(DELETE_MADE_AHEAD, {"definition": definition_id})
        rows = cursor.fetchall()
    return [key for key, _ in rows if key], min((due for _, due in rows), default=None)


def delete_runs_of(definition_id: int, batch: int = 5000) -> int:
    """Delete every run of a definition in batches, each its own transaction, from the current
    shard database (the definition's); return how many."""
    deleted = 0
    while True:
        with transaction.atomic(using=shards.current()), shards.cursor() as cursor:
            cursor.execute(DELETE_OF_DEFINITION, {"definition": definition_id, "batch": batch})
            deleted_rows = cursor.fetchall()
            cursor.execute(DELETE_ATTEMPTS, {"runs": [row[0] for row in deleted_rows]})
            keys = [row[1] for row in deleted_rows]
        payloads.delete_unreferenced(keys)
        deleted += len(keys)
        if len(keys) < batch:
            return deleted


def delete_old_audit(batch: int) -> int:
    with transaction.atomic(using=shards.CONTROL), connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(
            DELETE_AUDIT, {"days": settings.SCHEDULER_AUDIT_RETENTION_DAYS, "batch": batch}
        )
        return cursor.rowcount


def handle_one_round(*, batch: int | None = None) -> int:
    """Delete one batch per team on every shard database, and one of the audit trail and of
    idle workers; relay a batch of each shard database's kept audit events; return the rows
    deleted. A shard database that is down is passed over until the next round."""
    from apps.teams.models import MAX_RETENTION_DAYS, Team

    batch = batch or settings.SCHEDULER_RETENTION_BATCH
    # A team's own value is bounded as the site's is: the column holds what a database client or
    # a shell put there (the model's validator guards forms only), and 2 000 000 000 days ago is
    # no date PostgreSQL has.
    teams = [
        (
            team_id,
            min(settings.SCHEDULER_RETENTION_DAYS if days is None else days, MAX_RETENTION_DAYS),
        )
        for team_id, days in Team.objects.values_list("pk", "retention_days")
    ]

    def one_database() -> int:
        alias = shards.current()
        deleted = sum(_delete_isolating(team_id, days, batch) for team_id, days in teams)
        if alias != shards.CONTROL:
            relay(alias, batch)
        return deleted + counters.delete_old()

    per_database, unavailable = shards.gather(one_database)
    if unavailable:
        log.warning("retention passed over shards %s: database unavailable", unavailable)
    deleted = (
        sum(per_database)
        + delete_old_audit(batch)
        + workers.forget_idle(batch)
        + payloads.sweep_stranded(batch)
    )
    if deleted:
        log.info("retention deleted %d rows", deleted)
    return deleted
