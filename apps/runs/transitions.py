"""Run transitions that people and management clients ask for: create, cancel, retry, requeue,
discard. Each is a conditional UPDATE (a row count of 0 means the run was not in a state that
allows it) and writes an audit event. The worker-facing transitions are in `store`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction

from apps.audit.record import Actor, record
from apps.jobs.models import JobDefinition
from apps.jobs.services import database_now
from apps.runs import payloads
from apps.runs.ids import public_run_id
from apps.runs.models import Run, Trigger
from apps.runs.store import NewRun, insert_runs, notify_ready


class TransitionError(Exception):
    """The run is not in a state that allows the change (the API answers 409)."""


class IdempotencyConflict(TransitionError):
    """The idempotency key names an existing run whose payload differs from the one asked for."""

    def __init__(self, run: Run, fields: list[str]) -> None:
        where = f" (fields that differ: {', '.join(fields)})" if fields else ""
        super().__init__(
            f"The idempotency key '{run.idempotency_key}' belongs to {run.run_id}, created "
            f"with a different payload{where}; use a new key for a new run."
        )
        self.run = run
        self.fields = fields


@dataclass(frozen=True)
class Created:
    run: Run
    created: bool


def payload_difference(existing: Any, asked: Any) -> list[str] | None:
    """None when the payloads are equal, else the top-level fields that differ ([] when one is
    not an object)."""
    if existing == asked:
        return None
    if isinstance(existing, dict) and isinstance(asked, dict):
        keys = set(existing) | set(asked)
        return sorted(k for k in keys if existing.get(k, _MISSING) != asked.get(k, _MISSING))
    return []


_MISSING = object()


def create_run(
    definition: JobDefinition,
    actor: Actor,
    *,
    idempotency_key: str | None,
    delay_seconds: int | None = None,
    run_at: datetime | None = None,
    payload: Any = None,
    trigger: str = Trigger.API,
) -> Created:
    """Create a delayed, one-off or immediate run; the same idempotency key returns the existing one."""
    due = run_at if run_at is not None else database_now() + timedelta(seconds=delay_seconds or 0)
    key = idempotency_key or f"{definition.name}@{trigger}-{uuid.uuid4().hex}"
    with transaction.atomic():
        new_ids = insert_runs([NewRun(definition.pk, trigger, due, due, key, payload)])
        if new_ids:
            run = Run.objects.get(pk=new_ids[0])
            record(
                actor,
                "run.create" if trigger == Trigger.API else "job.trigger",
                team=definition.team,
                target_type="run",
                target=run.run_id,
                after={"job": definition.name, "idempotencyKey": key, "dueAt": due.isoformat()},
            )
            return Created(run, True)
    run = Run.objects.select_related("definition", "team").get(
        definition=definition, idempotency_key=key
    )
    # The same key with another payload is a different request: answering the old run as if it
    # were this one would drop the new payload without a word. A request without a payload
    # asks for none in particular.
    if payload is not None:
        difference = payload_difference(payloads.load(run.payload, run.payload_key), payload)
        if difference is not None:
            raise IdempotencyConflict(run, difference)
    return Created(run, False)


# Served by the primary key; the state list in each WHERE is the transition's precondition.
CANCEL = """
UPDATE runs_run SET state = 'cancelled', finished_at = now()
WHERE id = ANY(%(ids)s::bigint[]) AND state IN ('scheduled', 'ready', 'retrying')
RETURNING id, queue
"""
RETRY_NOW = """
UPDATE runs_run SET state = 'ready', available_at = now()
WHERE id = ANY(%(ids)s::bigint[]) AND state = 'retrying'
RETURNING id, queue
"""
# A requeued run gets a fresh attempt budget: as many more attempts as its definition allows.
REQUEUE = """
UPDATE runs_run r
SET state = 'ready', available_at = now(), finished_at = NULL,
    max_attempts = r.attempt + d.retry_max_attempts
FROM jobs_jobdefinition d
WHERE r.id = ANY(%(ids)s::bigint[]) AND d.id = r.definition_id AND r.state = 'dead'
RETURNING r.id, r.queue
"""
# A discarded DLQ run is kept (its history stays readable until retention) but leaves the DLQ.
DISCARD = """
UPDATE runs_run SET state = 'cancelled'
WHERE id = ANY(%(ids)s::bigint[]) AND state = 'dead'
RETURNING id, queue
"""


def _transition(
    sql: str, runs: Sequence[Run], actor: Actor, action: str, *, wakes: bool
) -> list[Run]:
    by_id = {run.pk: run for run in runs}
    if not by_id:
        return []
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(sql, {"ids": list(by_id)})
            changed = cursor.fetchall()
        if wakes:
            notify_ready(queue for _, queue in changed)
        for run_id, _ in changed:
            run = by_id[run_id]
            record(
                actor,
                action,
                team=run.team,
                target_type="run",
                target=public_run_id(run_id),
                before={"state": run.state},
                after={"state": _after_state(action)},
            )
    changed_ids = {run_id for run_id, _ in changed}
    return [run for run in runs if run.pk in changed_ids]


def _after_state(action: str) -> str:
    return {
        "run.cancel": "cancelled",
        "run.retry": "ready",
        "dlq.requeue": "ready",
        "dlq.discard": "cancelled",
    }[action]


def cancel(runs: Sequence[Run], actor: Actor) -> list[Run]:
    return _transition(CANCEL, runs, actor, "run.cancel", wakes=False)


def requeue(runs: Sequence[Run], actor: Actor) -> list[Run]:
    return _transition(REQUEUE, runs, actor, "dlq.requeue", wakes=True)


def discard(runs: Sequence[Run], actor: Actor) -> list[Run]:
    return _transition(DISCARD, runs, actor, "dlq.discard", wakes=False)


def retry(runs: Sequence[Run], actor: Actor) -> list[Run]:
    """Run now: a retrying run skips the rest of its backoff; a dead one is requeued."""
    dead = [run for run in runs if run.state == "dead"]
    waiting = [run for run in runs if run.state != "dead"]
    return _transition(RETRY_NOW, waiting, actor, "run.retry", wakes=True) + requeue(dead, actor)


def require_one(changed: list[Run], run: Run, verb: str) -> Run:
    """Raise a TransitionError naming the state when a single-run transition did not apply."""
    if not changed:
        run.refresh_from_db()
        raise TransitionError(f"cannot {verb} a run that is {run.state}")
    run.refresh_from_db()
    return run
