"""Answers in the API's camelCase names (README, "API"), built through their shapes (apps/api/shapes)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from apps.api.shapes import jobs as job_shape
from apps.api.shapes import runs as run_shape
from apps.jobs.models import JobDefinition
from apps.jobs.services import snapshot
from apps.runs import limits, payloads
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import PRIORITY_NAMES, Outcome, reported_state

NAME_RE = limits.JOB_NAME_RE
QUEUE_RE = limits.QUEUE_NAME_RE


def definition_json(
    definition: JobDefinition, fields: dict[str, Any] | None = None
) -> job_shape.DefinitionAnswer:
    """A definition's representation; `fields`: its `snapshot`, when the caller has it."""
    fields = fields or snapshot(definition)
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
        concurrencyPerKey=fields["concurrencyPerKey"],
        concurrencyKeyField=fields["concurrencyKeyField"],
        rateLimit=fields["rateLimit"],
        payload=fields["payload"],
        paused=fields["paused"],
        dryRun=fields["dryRun"],
        latenessSloSeconds=fields["latenessSloSeconds"],
        owner=fields["owner"],
        runbookUrl=fields["runbookUrl"],
        team=definition.team.slug,
        nextDueAt=format_utc(definition.next_due_at),
        shard=definition.shard,
        missedRunsNote=definition.missed_runs_note,
        createdAt=format_utc(definition.created_at),
        updatedAt=format_utc(definition.updated_at),
    )


def run_json(run, now: datetime) -> run_shape.Run:
    # A literal, held to run_shape.Run by a type checker as the class's call would be (the
    # call builds a keyword dict more per run: a bulk enqueue answers up to 1 000 of them).
    return {
        "runId": public_run_id(run.pk),
        "job": run.definition.name,
        "team": run.team.slug if hasattr(run, "team") else None,
        "queue": run.queue,
        "priority": PRIORITY_NAMES[run.priority],
        "state": reported_state(run.state, run.available_at, now),
        "attempt": run.attempt,
        "maxAttempts": run.max_attempts,
        "dueAt": format_utc(run.due_at),
        "availableAt": format_utc(run.available_at),
        "idempotencyKey": run.idempotency_key,
        "concurrencyKey": run.concurrency_key,
        "fencingToken": run.fencing_token,
        "leaseExpiresAt": format_utc(run.lease_expires_at),
        "workerId": run.worker_id or None,
        "cancelRequested": run.cancel_requested,
        "trigger": run.trigger,
        "dryRun": run.dry_run,
        "payload": payloads.shown(run.payload, run.payload_key)[0],
        "result": run.result,
        "lastError": run.last_error,
        "createdAt": format_utc(run.created_at),
        "startedAt": format_utc(run.started_at),
        "finishedAt": format_utc(run.finished_at),
    }


def run_detail_json(run, now: datetime) -> run_shape.RunDetail:
    """A run with its attempts, oldest first."""
    attempts = [attempt_json(attempt) for attempt in run.attempts.order_by("fencing_token")]
    return run_shape.RunDetail(**run_json(run, now), attempts=attempts)


def attempt_json(attempt) -> run_shape.Attempt:
    # A failed attempt has an error even when its worker gave none (`{"message": "", "type":
    # ""}`, as the run's `lastError` keeps it); another outcome has one only when it says why.
    error = (
        run_shape.RunError(message=attempt.error_message, type=attempt.error_type)
        if attempt.outcome == Outcome.FAILED or attempt.error_message or attempt.error_type
        else None
    )
    if error is not None and attempt.error_stack:
        error["stack"] = attempt.error_stack
    return run_shape.Attempt(
        attempt=attempt.number,
        fencingToken=attempt.fencing_token,
        workerId=attempt.worker_id,
        leasedAt=format_utc(attempt.leased_at),
        lastHeartbeatAt=format_utc(attempt.last_heartbeat_at),
        endedAt=format_utc(attempt.ended_at),
        outcome=attempt.outcome or None,
        error=error,
    )
