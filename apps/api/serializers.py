"""Answers in the API's camelCase names (README, "API"), built through their shapes (apps/api/shapes)."""

from __future__ import annotations

import functools
from datetime import UTC, datetime

from apps.api.shapes import jobs as job_shape
from apps.api.shapes import runs as run_shape
from apps.jobs.models import JobDefinition
from apps.jobs.services import snapshot
from apps.runs import limits, payloads
from apps.runs.ids import public_run_id
from apps.runs.models import PRIORITY_NAMES, reported_state

NAME_RE = limits.JOB_NAME_RE
QUEUE_RE = limits.QUEUE_NAME_RE


@functools.lru_cache(maxsize=4096)
def iso(value: datetime | None) -> str | None:
    """Render an instant in UTC with a Z, to the millisecond when it has a fraction.

    Cached: the worker API formats two instants per run, and the leases of one claim share
    their expiry (a hit costs a twentieth of formatting)."""
    if value is None:
        return None
    value = value.astimezone(UTC)
    spec = "milliseconds" if value.microsecond else "seconds"
    return value.replace(tzinfo=None).isoformat(timespec=spec) + "Z"


def definition_json(definition: JobDefinition) -> job_shape.DefinitionAnswer:
    fields = snapshot(definition)
    retry = fields["retry"]
    return job_shape.DefinitionAnswer(
        name=fields["name"],
        schedule=fields["schedule"],
        queue=fields["queue"],
        priority=fields["priority"],
        timeoutSeconds=fields["timeoutSeconds"],
        retry=job_shape.RetryPolicy(
            maxAttempts=retry["maxAttempts"],
            baseSeconds=retry["baseSeconds"],
            maxSeconds=retry["maxSeconds"],
        ),
        concurrency=fields["concurrency"],
        payload=fields["payload"],
        paused=fields["paused"],
        dryRun=fields["dryRun"],
        latenessSloSeconds=fields["latenessSloSeconds"],
        owner=fields["owner"],
        runbookUrl=fields["runbookUrl"],
        team=definition.team.slug,
        nextDueAt=iso(definition.next_due_at),
        shard=definition.shard,
        missedRunsNote=definition.missed_runs_note,
        createdAt=iso(definition.created_at),
        updatedAt=iso(definition.updated_at),
    )


def run_json(run, now: datetime) -> run_shape.Run:
    return run_shape.Run(
        runId=public_run_id(run.pk),
        job=run.definition.name,
        team=run.team.slug if hasattr(run, "team") else None,
        queue=run.queue,
        priority=PRIORITY_NAMES[run.priority],
        state=reported_state(run.state, run.available_at, now),
        attempt=run.attempt,
        maxAttempts=run.max_attempts,
        dueAt=iso(run.due_at),
        availableAt=iso(run.available_at),
        idempotencyKey=run.idempotency_key,
        fencingToken=run.fencing_token,
        leaseExpiresAt=iso(run.lease_expires_at),
        workerId=run.worker_id or None,
        trigger=run.trigger,
        dryRun=run.dry_run,
        payload=payloads.load(run.payload, run.payload_key),
        result=run.result,
        lastError=run.last_error,
        createdAt=iso(run.created_at),
        startedAt=iso(run.started_at),
        finishedAt=iso(run.finished_at),
    )


def run_detail_json(run, now: datetime) -> run_shape.RunDetail:
    """A run with its attempts, oldest first."""
    attempts = [attempt_json(attempt) for attempt in run.attempts.order_by("fencing_token")]
    return run_shape.RunDetail(**run_json(run, now), attempts=attempts)


def attempt_json(attempt) -> run_shape.Attempt:
    error = (
        run_shape.RunError(message=attempt.error_message, type=attempt.error_type)
        if attempt.error_message or attempt.error_type
        else None
    )
    return run_shape.Attempt(
        attempt=attempt.number,
        fencingToken=attempt.fencing_token,
        workerId=attempt.worker_id,
        leasedAt=iso(attempt.leased_at),
        lastHeartbeatAt=iso(attempt.last_heartbeat_at),
        endedAt=iso(attempt.ended_at),
        outcome=attempt.outcome or None,
        error=error,
    )
