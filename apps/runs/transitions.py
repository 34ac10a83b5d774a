"""Run transitions that people and management clients ask for: cancel, retry, requeue,
discard. Each is a conditional UPDATE (a row count of 0 means the run was not in a state that
allows it) and writes an audit event. The worker-facing transitions are in `store`; creating
runs of a definition is `apps.jobs.enqueue`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError

from apps.audit.record import Actor, kept_with_rows, record
from apps.runs import shards
from apps.runs.clock import database_now
from apps.runs.filters import BulkFilter
from apps.runs.ids import public_run_id
from apps.runs.models import Run, reported_state
from apps.runs.store import atomic, notify_ready, server_cursor

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from apps.teams.models import Team


class TransitionError(Exception):
    """The run is not in a state that allows the change (the API answers 409)."""


# Served by the primary key; the state list in each WHERE is the transition's precondition.
# Every statement answers (id, queue, state after). Each locks its runs in id order first (the
# subquery), as every statement that changes several runs does (store.leased_targets,
# store.MARK_LIMITED): in the order a plan happened to read them, a requeue and a discard of the
# same dead runs, or a requeue and an edit of their job's limits, each held a run the other
# waited for, and the deadlock detector failed one (a 503 to an operator).
#
# Cancel: a waiting run at once; a leased run is not taken from its worker: the next heartbeat
# tells it to stop (409, `…/cancelled`), and its report or its lease's expiry ends it cancelled
# (store.py). One statement for both, so that a run changing state under the cancel (a reaper or
# a claim committing first: the lock waits for it, then re-reads the row) is cancelled as it
# then is, never refused for what it was.
CANCELLABLE = (
    "(state IN ('scheduled', 'ready', 'retrying') OR (state = 'leased' AND NOT cancel_requested))"
)
CANCEL = f"""
UPDATE runs_run
SET state = CASE WHEN state = 'leased' THEN state ELSE 'cancelled' END,
    finished_at = CASE WHEN state = 'leased' THEN finished_at ELSE now() END,
    cancel_requested = cancel_requested OR state = 'leased'
WHERE id IN (
    SELECT id FROM runs_run WHERE id = ANY(%(ids)s::bigint[]) AND {CANCELLABLE}
    ORDER BY id FOR UPDATE
) AND {CANCELLABLE}
RETURNING id, queue, state
"""
RETRY_NOW = """
UPDATE runs_run SET state = 'ready', available_at = now()
WHERE id IN (
    SELECT id FROM runs_run WHERE id = ANY(%(ids)s::bigint[]) AND state = 'retrying'
    ORDER BY id FOR UPDATE
) AND state = 'retrying'
RETURNING id, queue, state
"""
# The dead runs of a list, locked in id order.
LOCK_DEAD = """
    SELECT id FROM runs_run WHERE id = ANY(%(ids)s::bigint[]) AND state = 'dead'
    ORDER BY id FOR UPDATE
"""
# A requeued run gets a fresh attempt budget: as many more attempts as its definition allows.
REQUEUE = f"""
UPDATE runs_run r
SET state = 'ready', available_at = now(), finished_at = NULL,
    max_attempts = r.attempt + d.retry_max_attempts
FROM jobs_jobdefinition d
WHERE r.id IN ({LOCK_DEAD}) AND d.id = r.definition_id AND r.state = 'dead'
RETURNING r.id, r.queue, r.state
"""
# A discarded DLQ run is kept (its history stays readable until retention) but leaves the DLQ.
# Retention counts from the discard: counted from its death, a run that sat in the DLQ longer
# than the team's retention was deleted by the next round, seconds after.
DISCARD = f"""
UPDATE runs_run SET state = 'cancelled', finished_at = now()
WHERE id IN ({LOCK_DEAD}) AND state = 'dead'
RETURNING id, queue, state
"""


def _transition(
    sql: str, runs: Sequence[Run], actor: Actor, action: str, *, wakes: bool
) -> list[Run]:
    by_id = {run.pk: run for run in runs}
    if not by_id:
        return []
    for run in runs:  # a shard being moved takes no changes (apps/scheduler/moves.py)
        shards.writable(run.shard)
    changed: list[tuple[int, str, str]] = []
    unreached: list[str] = []
    # Each run's event is written in its database's transaction, with the change
    # (`kept_with_rows`: relayed to the trail after the commit where that is a shard database
    # of its own), so that a run changed has its event whichever database fails at its commit.
    # One transaction per database, the control database's first: committed last, inside the
    # others, its failure came after theirs had committed and was answered as if none had.
    groups = shards.runs_by_database(list(by_id))
    with kept_with_rows():
        for alias in sorted(groups, key=lambda alias: alias != shards.CONTROL):
            ids = groups[alias]
            try:
                with shards.using(alias), atomic(savepoint=False), server_cursor() as cursor:
                    cursor.execute(sql, {"ids": ids})
                    done = cursor.fetchall()
                    if wakes:
                        notify_ready(queue for _, queue, _ in done)
                    for run_id, _, state in done:
                        _audit_one(by_id[run_id], state, actor, action)
            except DatabaseError:
                if not changed:
                    raise  # nothing was changed: the caller's 503 says so
                # Down, or failed at its commit: the others' changes stand. Go on, then say so.
                log.warning("runs of %s not changed", alias, exc_info=True)
                unreached.append(alias)
                continue
            changed += done
    changed_ids = {run_id for run_id, _, _ in changed}
    made = [run for run in runs if run.pk in changed_ids]
    if unreached:
        raise PartlyTransitioned(made, [shards.span(alias) for alias in unreached])
    return made


class PartlyTransitioned(Exception):
    """A change of runs in several databases reached some and not others (down, or failed at
    their commit): `changed` are the runs changed, `spans` the shards whose runs were not."""

    def __init__(self, changed: list[Run], spans: list[str]) -> None:
        self.changed = changed
        self.spans = spans
        super().__init__(f"shards {', '.join(spans)} are unavailable: their runs were not changed")


def _audit_one(run: Run, state: str, actor: Actor, action: str) -> None:
    # A cancel that found the run leased asked its worker to stop.
    done_as = "run.cancel_request" if action == "run.cancel" and state == "leased" else action
    record(
        actor,
        done_as,
        team=run.team,
        target_type="run",
        target=public_run_id(run.pk),
        before={"state": run.state},
        after=_after(done_as),
    )


def _after(action: str) -> dict[str, object]:
    if action == "run.cancel_request":
        return {"state": "leased", "cancelRequested": True}
    state = {
        "run.cancel": "cancelled",
        "run.retry": "ready",
        "dlq.requeue": "ready",
        "dlq.discard": "cancelled",
    }[action]
    return {"state": state}


def cancel(runs: Sequence[Run], actor: Actor) -> list[Run]:
    """Cancel waiting runs now; ask the workers of leased ones to stop (they end cancelled when
    the worker reports or the lease expires)."""
    return _transition(CANCEL, runs, actor, "run.cancel", wakes=False)


def requeue(runs: Sequence[Run], actor: Actor) -> list[Run]:
    return _transition(REQUEUE, runs, actor, "dlq.requeue", wakes=True)


def discard(runs: Sequence[Run], actor: Actor) -> list[Run]:
    return _transition(DISCARD, runs, actor, "dlq.discard", wakes=False)


def retry(runs: Sequence[Run], actor: Actor) -> list[Run]:
    """Run now: a retrying run skips the rest of its backoff; a dead one is requeued. Two
    changes, each a transaction per database: what one made stands whatever the other meets
    (PartlyTransitioned says both halves' runs and shards)."""
    dead = [run for run in runs if run.state == "dead"]
    waiting = [run for run in runs if run.state != "dead"]
    made: list[Run] = []
    unreached: list[str] = []
    for change in (
        lambda: _transition(RETRY_NOW, waiting, actor, "run.retry", wakes=True),
        lambda: requeue(dead, actor),
    ):
        try:
            made += change()
        except PartlyTransitioned as exc:
            made += exc.changed
            unreached += [span for span in exc.spans if span not in unreached]
        except DatabaseError:
            if not made:
                raise  # nothing was changed
            log.warning("retry: the dead runs were not requeued", exc_info=True)
            unreached += [shards.span(alias) for alias in shards.runs_by_database(
                [run.pk for run in dead]) if shards.span(alias) not in unreached]  # fmt: skip
    if unreached:
        raise PartlyTransitioned(made, unreached)
    return made


# --- everything a filter selects ------------------------------------------------------------
# One statement per shard database, whatever the count: no run is read into Python, and the
# action is audited once per team with the filter and the count (not once per run: 5 000
# events for one decision drowned the audit trail). Served by run_team_state (team_id, state,
# -id), or for an error group by run_failed_by_fingerprint; the WHERE's state list is the
# transition's precondition, as in the statements above.


@dataclass(frozen=True)
class MatchingAction:
    audit: str  # the audit event's action
    states: frozenset[str]  # the stored states it changes
    after: str  # the state they end in
    wakes: bool  # claimable at once: wake the queues' waiting workers
    sql: str  # the UPDATE, up to its WHERE's filter conditions


# The runs are locked in id order first, as the statements above lock theirs. The outer WHERE
# repeats the conditions so that it too is served by run_team_state: with the state alone it
# scanned every team's runs in those states (472 ms against 238 for 14 000 of 600 000 dead).
_MATCHING = """
WITH changed AS (
    {update}
      AND r.id IN (
        SELECT r.id FROM runs_run r
        WHERE r.team_id = ANY(%(teams)s::bigint[]) AND r.state = ANY(%(states)s::text[])
          AND {{where}}
        ORDER BY r.id FOR UPDATE
      )
      AND r.team_id = ANY(%(teams)s::bigint[]) AND r.state = ANY(%(states)s::text[])
      AND {{where}}
    RETURNING r.team_id, r.queue
)
SELECT team_id, queue, count(*) FROM changed GROUP BY team_id, queue
"""
MATCHING = {
    # A retrying run skips the rest of its backoff; a dead one is requeued (a fresh budget).
    "retry": MatchingAction(
        "run.retry",
        frozenset({"retrying", "dead"}),
        "ready",
        True,
        _MATCHING.format(
            update="""UPDATE runs_run r
    SET state = 'ready', available_at = now(), finished_at = NULL,
        max_attempts = CASE WHEN r.state = 'dead' THEN r.attempt + d.retry_max_attempts
                            ELSE r.max_attempts END
    FROM jobs_jobdefinition d
    WHERE d.id = r.definition_id"""
        ),
    ),
    "requeue": MatchingAction(
        "dlq.requeue",
        frozenset({"dead"}),
        "ready",
        True,
        _MATCHING.format(
            update="""UPDATE runs_run r
    SET state = 'ready', available_at = now(), finished_at = NULL,
        max_attempts = r.attempt + d.retry_max_attempts
    FROM jobs_jobdefinition d
    WHERE d.id = r.definition_id"""
        ),
    ),
    # Waiting runs only: a leased one is asked to stop one at a time (`cancel`).
    "cancel": MatchingAction(
        "run.cancel",
        frozenset({"scheduled", "ready", "retrying"}),
        "cancelled",
        False,
        _MATCHING.format(
            update="""UPDATE runs_run r SET state = 'cancelled', finished_at = now()
    WHERE true"""
        ),
    ),
    "discard": MatchingAction(
        "dlq.discard",
        frozenset({"dead"}),
        "cancelled",
        False,
        _MATCHING.format(
            update="UPDATE runs_run r SET state = 'cancelled', finished_at = now()\n    WHERE true"
        ),
    ),
}


def act_on_matching(
    name: str,
    teams: Sequence[Team],
    states: Sequence[str],
    flt: BulkFilter,
    actor: Actor,
) -> int:
    """Apply the action `name` (MATCHING) to every run of `teams` in `states` (those the
    action accepts) that `flt` selects; return how many changed.

    1. Refuse while a shard is being moved (`shards.Moving`) and when a shard database cannot
       be reached (`shards.Unavailable`): every database's transaction is open before any
       statement runs, so nothing changes then.
    2. One UPDATE per shard database; its queues' waiting workers woken when runs are ready.
    3. One audit event per team that had runs changed, with the filter, the states and the
       count, committed with the runs: with shards on servers of their own, one per team and
       database (`shards` in the event names the database's), so that whichever database
       fails at its commit, the runs changed have their events; PartlyChanged then says how
       many were changed and which shards were not.
    """
    action = MATCHING[name]
    wanted = sorted(action.states.intersection(states))
    by_id = {team.pk: team for team in teams}
    if not wanted or not by_id:
        return 0
    moving = sorted(shards.moving())
    if moving:
        raise shards.Moving(moving[0])
    where, params = flt.where()
    sql = action.sql.format(where=where)
    params = {**params, "teams": sorted(by_id), "states": wanted}
    changed: dict[str, int] = {}
    try:
        with shards.writing_everywhere():
            _matching_everywhere(action, sql, params, by_id, wanted, flt, actor, changed)
    except shards.PartlyCommitted as exc:
        done = set(exc.committed)
        raise PartlyChanged(
            exc,
            sum(n for alias, n in changed.items() if alias in done),
            [shards.span(alias) for alias in shards.databases() if alias not in done],
        ) from exc
    return sum(changed.values())


class PartlyChanged(shards.PartlyCommitted):
    """An action on everything matching changed `count` runs, in the databases that committed
    theirs; one failed at its commit, and the runs of the shards `spans` were not changed."""

    def __init__(self, cause: shards.PartlyCommitted, count: int, spans: list[str]) -> None:
        super().__init__(cause.committed, cause.failed)
        self.count = count
        self.spans = spans


def _matching_everywhere(
    action: MatchingAction,
    sql: str,
    params: dict[str, Any],
    by_id: dict[int, Team],
    wanted: list[str],
    flt: BulkFilter,
    actor: Actor,
    changed: dict[str, int],
) -> None:
    """act_on_matching's statements, inside its transactions; `changed` gets each database's
    count."""
    for alias in shards.databases():
        # Django's cursor, which binds on the client: planned for these values, so a group's
        # states prove the partial index's predicate (a prepared, generic plan could not).
        with shards.using(alias), shards.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
            if action.wakes:
                notify_ready(queue for _, queue, _ in rows)
            by_team: dict[int, int] = {}
            for team_id, _, count in rows:
                by_team[team_id] = by_team.get(team_id, 0) + count
            # In this database's transaction, with the runs it changed (`kept_with_rows`):
            # one event per team and database where shards have servers of their own.
            for team_id, count in sorted(by_team.items()):
                after: dict[str, object] = {"state": action.after, "count": count}
                if shards.physical():
                    after["shards"] = shards.span(alias)
                record(
                    actor,
                    action.audit,
                    team=by_id[team_id],
                    target_type="filter",
                    target=flt.describe()[:300],
                    before={"filter": flt.as_json(), "states": wanted},
                    after=after,
                )
            changed[alias] = sum(by_team.values())


def require_one(changed: list[Run], run: Run, verb: str) -> Run:
    """Raise a TransitionError naming the state when a single-run transition did not apply."""
    if not changed:
        run.refresh_from_db()
        # The state as the API and the dashboard show it: a due waiting run is `ready`.
        shown = reported_state(run.state, run.available_at, database_now())
        raise TransitionError(f"cannot {verb} a run that is {shown}")
    run.refresh_from_db()
    return run
