"""Creating runs of a definition: delayed, one-off and immediate runs asked for through the API,
the dashboard's "trigger now", and the demo. The same idempotency key returns the existing run.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

from apps.audit.record import Actor, record
from apps.jobs.models import JobDefinition
from apps.runs import payloads
from apps.runs.clock import database_now
from apps.runs.models import Run, Trigger
from apps.runs.store import NewRun, insert_runs
from apps.runs.transitions import TransitionError


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
