"""The management API's run shapes: one-off runs, runs with their attempts, and the DLQ."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, NotRequired

from django.conf import settings
from pydantic import AfterValidator, ConfigDict, Field, field_validator
from pydantic import with_config as typed_config
from typing_extensions import TypedDict

from apps.api.shapes import ANSWER, STRICT, Body, Instant, UnavailableShards, json_value, problem
from apps.api.shapes.jobs import (
    AwareTime,
    Checked,
    PriorityEnum,
    errors_within,
    no_default,
)
from apps.api.shapes.worker import ItemStatus, JobName, RunState
from apps.jobs import schedule as sched
from apps.runs import filters, limits
from apps.runs.clock import database_now

Trigger = Literal["cron", "catch_up", "api", "manual", "backfill"]
# `cancelled`: the run was cancelled while this attempt held it (its worker stopped, or its
# lease ended).
Outcome = Literal["succeeded", "failed", "lease_expired", "timed_out", "cancelled"]


# --- requests ---------------------------------------------------------------------------------


class CreateRun(Body):
    """A delayed (`delaySeconds`) or one-off (`runAt`) run, at most one of the two; neither
    means now."""

    idempotencyKey: Annotated[str, Field(min_length=1, max_length=300), Checked] | None = None
    delaySeconds: int | None = Field(None, ge=0, le=366 * 86400)
    runAt: AwareTime = Field(None, description="With an offset or Z.")
    payload: Any = Field(None, description="Any JSON value; over the payload cap it is a 413.")
    priority: PriorityEnum | None = Field(None, description="Default: the job's priority.")
    concurrencyKey: Annotated[str, Field(min_length=1, max_length=200), Checked] | None = Field(
        None, description="Groups runs for per-key limits, e.g. `customer-42`."
    )

    _payload = field_validator("payload")(json_value)

    def problems(self) -> dict[str, list[str]]:
        if self.delaySeconds is not None and self.runAt is not None:
            return {"runAt": ["Give either delaySeconds or runAt, not both."]}
        return self.time_problems(database_now()) if self.runAt is not None else {}

    def time_problems(self, now: datetime) -> dict[str, list[str]]:
        """A run due decades ago would start at once and count as decades late in every
        lateness figure of its queue: the past is for backfills."""
        reason = limits.run_time_problem(self.runAt, now) if self.runAt is not None else None
        return {"runAt": [reason]} if reason is not None else {}


class TriggerRun(Body):
    """A run of the job now; an empty body runs it with the job's payload."""

    payload: Any = Field(None, description="This run's payload instead of the job's.")

    _payload = field_validator("payload")(json_value)


class EnqueueItem(CreateRun):
    """One run to create: of which job (of the caller's team), under which key, when."""

    job: JobName

    def problems(self) -> dict[str, list[str]]:
        # The time window is checked by the batch, against one reading of the clock.
        if self.delaySeconds is not None and self.runAt is not None:
            return {"runAt": ["Give either delaySeconds or runAt, not both."]}
        if self.idempotencyKey is not None and sched.is_schedule_key(self.job, self.idempotencyKey):
            return {
                "idempotencyKey": [
                    f"Keys of the form {self.job}@<time with offset> are the schedule's own (its "
                    "cron runs, catch-ups and backfills): choose another."
                ]
            }
        return {}


class EnqueueBatch(Body):
    """Runs to create, of any jobs of the caller's team; each item is answered on its own."""

    # Validated item by item (enqueue_items), so that one bad item fails alone: the schema
    # still says what an item is.
    runs: list[Any] = Field(
        min_length=1,
        json_schema_extra=lambda schema: schema.update(maxItems=settings.SCHEDULER_MAX_ENQUEUE),
    )

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        schema = handler.resolve_ref_schema(handler(core_schema))
        schema["properties"]["runs"]["items"] = handler(EnqueueItem.__pydantic_core_schema__)
        return schema

    @field_validator("runs")
    @classmethod
    def _at_most(cls, value: list[Any]) -> list[Any]:
        if len(value) > settings.SCHEDULER_MAX_ENQUEUE:
            raise problem(
                "too_long",
                f"Ensure this field has no more than {settings.SCHEDULER_MAX_ENQUEUE} elements.",
            )
        return value


def _bulk_filter(value: Any) -> filters.BulkFilter:
    try:
        return filters.parse_bulk_filter(value)
    except filters.FilterError as exc:
        raise errors_within(
            {key.removeprefix("filter").lstrip("."): r for key, r in exc.errors.items()}, value
        ) from None


FILTER_SCHEMA = {
    "type": "object",
    "properties": {
        "job": {"type": "string", "minLength": 1, "description": "Only runs of this job."},
        "queue": {"type": "string", "minLength": 1, "description": "Only runs of this queue."},
        "since": {
            "type": "string",
            "format": "date-time",
            "description": "Only runs created at or after this time.",
        },
        "all": {"type": "boolean", "enum": [True], "description": "Every dead run, said outright."},
    },
    "minProperties": 1,
    "additionalProperties": False,
    "description": (
        "Non-empty `job`, `queue` (strings) and `since` (ISO time) fields, all of which a run "
        'must match; or `{"all": true}` for every run. An empty filter is a 400.'
    ),
}


class DlqSelection(Body):
    """Give either `runIds` or `filter`, not both."""

    model_config = ConfigDict(
        **STRICT, json_schema_extra={"oneOf": [{"required": ["runIds"]}, {"required": ["filter"]}]}
    )

    # Left out is not null: a null is refused like any other wrong type.
    # At least one: every other list of a body (heartbeats, results, runs) refuses none.
    runIds: list[Annotated[str, Field(min_length=1, max_length=40), Checked]] = Field(
        None, min_length=1, max_length=10000, json_schema_extra=no_default
    )
    filter: Annotated[Any, AfterValidator(_bulk_filter)] = Field(
        None, json_schema_extra=lambda schema: (schema.update(FILTER_SCHEMA), no_default(schema))
    )

    def problems(self) -> dict[str, list[str]]:
        if ("runIds" in self.model_fields_set) == ("filter" in self.model_fields_set):
            return {"runIds": ["Give either runIds or filter."]}
        return {}


# --- answers ----------------------------------------------------------------------------------


@typed_config(ANSWER)
class RunError(TypedDict, total=False):
    """The error a worker reported, or the reaper's reason (`lease_expired`, `timed_out`)."""

    message: str
    type: str
    stack: Annotated[str, Field(description="The worker's stack trace, when it sent one.")]


@typed_config(ANSWER)
class Run(TypedDict):
    """A run: one concrete execution of a definition."""

    runId: Annotated[str, Field(description="The public id, `run_…`.")]
    job: str
    team: str | None
    queue: str
    priority: PriorityEnum
    state: RunState
    attempt: Annotated[int, Field(ge=0)]
    maxAttempts: Annotated[int, Field(ge=0)]
    dueAt: Annotated[Instant, Field(description="The nominal time.")]
    availableAt: Annotated[Instant, Field(description="When it may be claimed.")]
    idempotencyKey: str
    concurrencyKey: str | None
    fencingToken: int | None
    leaseExpiresAt: Instant | None
    workerId: str | None
    cancelRequested: Annotated[
        bool,
        Field(
            description="A cancel was asked for while the run was leased: its worker is told "
            "to stop, and it ends `cancelled`."
        ),
    ]
    trigger: Trigger
    dryRun: bool
    payload: Any
    result: Any
    lastError: RunError | None
    createdAt: Instant
    startedAt: Instant | None
    finishedAt: Instant | None


@typed_config(ANSWER)
class Attempt(TypedDict):
    """One lease of a run."""

    attempt: Annotated[int, Field(ge=1)]
    fencingToken: int
    workerId: str
    leasedAt: Instant
    lastHeartbeatAt: Instant | None
    endedAt: Instant | None
    outcome: Outcome | None
    error: RunError | None


@typed_config(ANSWER)
class RunDetail(Run):
    """A run with its attempts, oldest first."""

    attempts: list[Attempt]


@typed_config(ANSWER)
class RunPage(TypedDict):
    """A page of runs, newest first."""

    results: list[Run]
    next: Annotated[str | None, Field(description="The next page, or null on the last.")]
    unavailableShards: NotRequired[UnavailableShards]


@typed_config(ANSWER)
class DlqActionAnswer(TypedDict):
    count: Annotated[int, Field(ge=0, description="How many runs changed.")]
    runIds: Annotated[list[str], Field(description="The runs changed.")]
    unavailableShards: NotRequired[
        Annotated[
            list[str],
            Field(
                description='Answered 207: the shards ("5-10") whose database could not be '
                "reached or failed at its commit after others had committed; their runs were not "
                "changed. The same call again changes them."
            ),
        ]
    ]


@typed_config(ANSWER)
class EnqueueDone(TypedDict):
    """An item that named a run: 201 created, or 200 the run its key already named."""

    status: Annotated[ItemStatus, Field(description="201 created, 200 existing.")]
    run: Run


@typed_config(ANSWER)
class EnqueueNamed(TypedDict):
    """An item that named a run, by its id alone: the answer asked for with
    `Prefer: return=minimal`."""

    status: Annotated[ItemStatus, Field(description="201 created, 200 existing.")]
    runId: Annotated[str, Field(description="The public id, `run_…`.")]


@typed_config(ANSWER)
class EnqueueRefused(TypedDict, total=False):
    """An item that created nothing, as problem details: 400 bad item, 404 no such job of the
    caller's team, 409 its key names a run with another payload."""

    status: Annotated[
        ItemStatus, Field(description="400, 404, 409, 413, or 503 when the job's shard is down.")
    ]
    type: str
    title: str
    detail: str
    errors: dict[str, list[str]]
    run: Run


@typed_config(ANSWER)
class EnqueueAnswer(TypedDict):
    runs: Annotated[
        list[EnqueueDone | EnqueueNamed | EnqueueRefused],
        Field(description="One answer per item, in order."),
    ]
