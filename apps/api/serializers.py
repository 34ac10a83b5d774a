"""Request validation and response shapes, in the API's camelCase names (DESIGN.md)."""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from rest_framework import serializers

from apps.api.errors import PayloadTooLarge, flatten_errors
from apps.api.parsers import payload_size
from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition
from apps.jobs.services import DefinitionSpec, snapshot
from apps.jobs.sync import InvalidEntry
from apps.runs import filters, limits, payloads
from apps.runs.clock import database_now
from apps.runs.ids import public_run_id
from apps.runs.models import PRIORITIES, PRIORITY_NAMES, reported_state

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


def check_payload_size(value: Any) -> Any:
    size = payload_size(value)
    if size > settings.SCHEDULER_PAYLOAD_MAX_BYTES:
        raise PayloadTooLarge(
            f"The payload is {size} bytes; the limit is {settings.SCHEDULER_PAYLOAD_MAX_BYTES}."
        )
    return value


class StrictSerializer(serializers.Serializer):
    """Refuse unknown fields, so a typo in a definition is an error rather than a silent default."""

    ignored_fields: frozenset[str] = frozenset()

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"body": ["Expected a JSON object."]})
        unknown = set(data) - set(self.fields) - self.ignored_fields
        errors = {name: ["Unknown field."] for name in sorted(unknown)}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            errors.update(exc.detail)
            raise serializers.ValidationError(errors) from exc
        if errors:
            raise serializers.ValidationError(errors)
        return value


class StrictIntegerField(serializers.IntegerField):
    """An integer that must be a JSON number: "5" and true are not 5."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictCharField(serializers.CharField):
    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class RetrySerializer(StrictSerializer):
    maxAttempts = StrictIntegerField(min_value=1, max_value=1000, default=3)
    baseSeconds = StrictIntegerField(min_value=0, max_value=86400, default=30)
    maxSeconds = StrictIntegerField(min_value=0, max_value=7 * 86400, default=1800)

    def validate(self, attrs):
        if attrs["maxSeconds"] < attrs["baseSeconds"]:
            raise serializers.ValidationError({"maxSeconds": ["Must be at least baseSeconds."]})
        return attrs


class ScheduleField(serializers.Field):
    default_error_messages = {"invalid": "Expected a schedule object."}

    def to_internal_value(self, data):
        try:
            return sched.schedule_to_json(sched.parse_schedule(data))
        except sched.ScheduleError as exc:
            # Keys come as "schedule.cron"; the serializer adds the "schedule." prefix back.
            raise serializers.ValidationError(
                {
                    key.removeprefix("schedule").lstrip(".") or "schedule": [reason]
                    for key, reason in exc.errors.items()
                }
            ) from exc

    def to_representation(self, value):
        return value


class JSONValueField(serializers.JSONField):
    """A JSON value within the payload cap and the depth limit (apps/runs/limits.py): bodies are
    checked when parsed, but the dashboard's forms and `apply` files come here directly."""

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        problem = limits.json_depth_problem(value)
        if problem is not None:
            raise serializers.ValidationError(problem[1])
        return check_payload_size(value)


READ_ONLY_DEFINITION_FIELDS = frozenset(
    {"team", "nextDueAt", "shard", "createdAt", "updatedAt", "missedRunsNote"}
)


class DefinitionSerializer(StrictSerializer):
    ignored_fields = READ_ONLY_DEFINITION_FIELDS

    name = StrictCharField(max_length=200)
    schedule = ScheduleField(default=dict)
    queue = StrictCharField(max_length=100, default="default")
    priority = serializers.ChoiceField(choices=list(PRIORITIES), default="default")
    timeoutSeconds = StrictIntegerField(min_value=1, max_value=7 * 86400, default=3600)
    retry = RetrySerializer(
        default=lambda: {"maxAttempts": 3, "baseSeconds": 30, "maxSeconds": 1800}
    )
    concurrency = StrictIntegerField(min_value=1, max_value=100000, allow_null=True, default=None)
    payload = JSONValueField(default=dict)
    paused = StrictBooleanField(default=False)
    dryRun = StrictBooleanField(default=False)
    latenessSloSeconds = StrictIntegerField(
        min_value=1, max_value=7 * 86400, allow_null=True, default=None
    )
    owner = StrictCharField(max_length=200, allow_blank=True, default="")
    runbookUrl = serializers.URLField(max_length=500, allow_blank=True, default="")

    def validate_name(self, value: str) -> str:
        if not NAME_RE.match(value):
            raise serializers.ValidationError(
                "Use lowercase dotted words of letters, digits, '-' and '_', e.g. 'billing.export-invoices'."
            )
        return value

    def validate_queue(self, value: str) -> str:
        if not QUEUE_RE.match(value):
            raise serializers.ValidationError("Use letters, digits, '.', ':', '-' and '_'.")
        return value

    def validate_schedule(self, value: dict) -> dict:
        run_at = value.get("runAt")
        if run_at is not None and sched.parse_schedule(value).run_at > limits.LATEST_RUN_TIME:
            raise serializers.ValidationError({"runAt": ["Later than 9999-01-01T00:00:00Z."]})
        return value

    def to_spec(self) -> DefinitionSpec:
        data = self.validated_data
        retry = data["retry"]
        return DefinitionSpec(
            name=data["name"],
            schedule=data["schedule"],
            queue=data["queue"],
            priority=PRIORITIES[data["priority"]],
            timeout_seconds=data["timeoutSeconds"],
            retry_max_attempts=retry["maxAttempts"],
            retry_base_seconds=retry["baseSeconds"],
            retry_max_seconds=retry["maxSeconds"],
            concurrency=data["concurrency"],
            payload=data["payload"],
            paused=data["paused"],
            dry_run=data["dryRun"],
            lateness_slo_seconds=data["latenessSloSeconds"],
            owner=data["owner"],
            runbook_url=data["runbookUrl"],
        )


def parse_definition(entry: Any) -> DefinitionSpec:
    """Validate one definition (jobs as code); raise InvalidEntry naming every bad field."""
    serializer = DefinitionSerializer(data=entry)
    if not serializer.is_valid():
        raise InvalidEntry(flatten_errors(serializer.errors))
    return serializer.to_spec()


def definition_json(definition: JobDefinition) -> dict[str, Any]:
    return {
        **snapshot(definition),
        "team": definition.team.slug,
        "nextDueAt": iso(definition.next_due_at),
        "shard": definition.shard,
        "missedRunsNote": definition.missed_runs_note,
        "createdAt": iso(definition.created_at),
        "updatedAt": iso(definition.updated_at),
    }


def run_json(run, now: datetime) -> dict[str, Any]:
    definition = run.definition
    return {
        "runId": public_run_id(run.pk),
        "job": definition.name,
        "team": run.team.slug if hasattr(run, "team") else None,
        "queue": run.queue,
        "priority": PRIORITY_NAMES[run.priority],
        "state": reported_state(run.state, run.available_at, now),
        "attempt": run.attempt,
        "maxAttempts": run.max_attempts,
        "dueAt": iso(run.due_at),
        "availableAt": iso(run.available_at),
        "idempotencyKey": run.idempotency_key,
        "fencingToken": run.fencing_token,
        "leaseExpiresAt": iso(run.lease_expires_at),
        "workerId": run.worker_id or None,
        "trigger": run.trigger,
        "dryRun": run.dry_run,
        "payload": payloads.load(run.payload, run.payload_key),
        "result": run.result,
        "lastError": run.last_error,
        "createdAt": iso(run.created_at),
        "startedAt": iso(run.started_at),
        "finishedAt": iso(run.finished_at),
    }


def attempt_json(attempt) -> dict[str, Any]:
    return {
        "attempt": attempt.number,
        "fencingToken": attempt.fencing_token,
        "workerId": attempt.worker_id,
        "leasedAt": iso(attempt.leased_at),
        "lastHeartbeatAt": iso(attempt.last_heartbeat_at),
        "endedAt": iso(attempt.ended_at),
        "outcome": attempt.outcome or None,
        "error": {"message": attempt.error_message, "type": attempt.error_type}
        if attempt.error_message or attempt.error_type
        else None,
    }


class CreateRunSerializer(StrictSerializer):
    idempotencyKey = StrictCharField(max_length=300, required=False, allow_null=True, default=None)
    delaySeconds = StrictIntegerField(
        min_value=0, max_value=366 * 86400, required=False, allow_null=True, default=None
    )
    runAt = serializers.DateTimeField(required=False, allow_null=True, default=None)
    payload = JSONValueField(required=False, allow_null=True, default=None)

    def validate_runAt(self, value):
        if value is not None and value.tzinfo is None:
            raise serializers.ValidationError("Give an offset or Z, e.g. 2026-12-01T10:00:00Z.")
        return value

    def validate(self, attrs):
        if attrs.get("delaySeconds") is not None and attrs.get("runAt") is not None:
            raise serializers.ValidationError(
                {"runAt": ["Give either delaySeconds or runAt, not both."]}
            )
        if attrs.get("runAt") is not None:
            # A run due decades ago would start at once and count as decades late in every
            # lateness figure of its queue: the past is for backfills.
            problem = limits.run_time_problem(attrs["runAt"], database_now())
            if problem is not None:
                raise serializers.ValidationError({"runAt": [problem]})
        return attrs


class RunIdsOrFilterSerializer(StrictSerializer):
    runIds = serializers.ListField(
        child=StrictCharField(max_length=40), required=False, max_length=10000
    )
    filter = serializers.JSONField(
        required=False,
        help_text=(
            "Non-empty `job`, `queue` (strings) and `since` (ISO time) fields, all of which "
            'a run must match; or `{"all": true}` for every run. An empty filter is a 400.'
        ),
    )

    def validate(self, attrs):
        if ("runIds" in attrs) == ("filter" in attrs):
            raise serializers.ValidationError({"runIds": ["Give either runIds or filter."]})
        if "filter" in attrs:
            try:
                attrs["filter"] = filters.parse_bulk_filter(attrs["filter"])
            except filters.FilterError as exc:
                raise serializers.ValidationError(exc.errors) from exc
        return attrs


class PreviewSerializer(StrictSerializer):
    name = StrictCharField(max_length=200, required=False, default="preview")
    schedule = ScheduleField()
    count = StrictIntegerField(min_value=1, max_value=1000, default=10)
    ignored_fields = frozenset({"from"})
