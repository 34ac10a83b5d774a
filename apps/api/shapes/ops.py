"""The operations API's shapes: why a run or a job is not running, queues, backfill, alerts."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field, PlainValidator, WithJsonSchema
from pydantic import with_config as typed_config
from typing_extensions import TypedDict  # pydantic reads only this one on Python 3.11

from apps.api.shapes import ANSWER, Body, Instant, UnavailableShards, problem
from apps.api.shapes.jobs import RateLimit, RateLimitAnswer
from apps.api.shapes.worker import RunState
from apps.runs.clock import read_iso
from apps.runs.filters import ISO_RULE


def offset_time(value: object) -> datetime:
    """An ISO 8601 time with an offset or Z, as given (not moved to UTC: the audit keeps it).

    A space stands for the `+` that a form or a query string turned into one."""
    parsed = read_iso(value, plus_as_space=True)
    if parsed is None or parsed.tzinfo is None:
        raise problem("datetime", ISO_RULE)
    return parsed


OffsetTime = Annotated[
    datetime,
    PlainValidator(offset_time),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
ReasonCode = Literal[
    "running",
    "finished",
    "job_deleted",
    "backoff",
    "scheduled",
    "definition_paused",
    "queue_paused",
    "concurrency_limit",
    "key_concurrency_limit",
    "rate_limit",
    "no_worker",
    "behind_higher_priority",
    "queued",
    "no_schedule",
    "schedule_done",
    "schedule_ended",
    "schedule_not_started",
    "not_materialised",
    "next_fire",
]
AlertKind = Literal["late", "missed"]


# --- requests ---------------------------------------------------------------------------------


class BackfillRequest(Body):
    """A past range of a cron job's fire times: previewed, or created when `confirm` is true."""

    from_: OffsetTime = Field(
        alias="from", description="Start of the range (inclusive), ISO 8601 with an offset."
    )
    to: OffsetTime = Field(description="End of the range (inclusive), ISO 8601 with an offset.")
    confirm: bool = Field(False, description="false: preview only; true: create.")


class QueueSettings(Body):
    """A queue's settings: its rate limit (null: none) and, when given, its pause. The limit is
    required: a PUT that only pauses, or an empty one, would otherwise lift it unsaid."""

    rateLimit: RateLimit | None = Field(
        description="At most `count` leases started from the queue, all its jobs together, in "
        "any window of `periodSeconds` (a sliding window, exact across shard databases); null "
        "for none.",
    )
    paused: bool | None = Field(None, description="Absent: unchanged.")


# --- answers ----------------------------------------------------------------------------------


@typed_config(ANSWER)
class Reason(TypedDict):
    """One thing that holds a run or a job, in plain words."""

    code: ReasonCode
    message: str
    detail: NotRequired[
        Annotated[dict[str, Any], Field(description="The facts behind it; absent when none.")]
    ]


@typed_config(ANSWER)
class WhyAnswer(TypedDict):
    subject: Annotated[str, Field(description="The run id or the job name.")]
    state: NotRequired[Annotated[RunState, Field(description="The run's state (runs only).")]]
    reasons: Annotated[list[Reason], Field(description="Empty when nothing holds it.")]


@typed_config(ANSWER)
class Queue(TypedDict):
    name: str
    paused: bool
    depth: Annotated[dict[str, int], Field(description="Ready runs by priority.")]
    oldestReadyAt: Instant | None
    lastLeasedAt: Instant | None
    lastWorkerId: str
    rateLimit: RateLimitAnswer | None
    rateUsed: Annotated[
        int | None,
        Field(description="Leases started within the current window; null without a rate limit."),
    ]


@typed_config(ANSWER)
class QueueList(TypedDict):
    results: list[Queue]
    unavailableShards: NotRequired[UnavailableShards]


@typed_config(ANSWER)
class BackfillAnswer(TypedDict):
    count: Annotated[int, Field(description="Cron times in the range (up to the cap).")]
    existing: Annotated[int, Field(description="Of those, times that already have a run.")]
    new: Annotated[int, Field(description="Runs a confirmed backfill creates.")]
    created: Annotated[int, Field(description="Runs created (0 for a preview).")]
    capped: Annotated[bool, Field(description="The range has more cron times than the cap.")]
    confirmed: bool
    until: Annotated[
        Instant,
        Field(
            description="Where the backfill stops: `to`, now when `to` is ahead, or the last "
            "cron time it covers when capped (the next backfill starts after it)."
        ),
    ]
    sample: Annotated[
        list[str], Field(description="The first local times, ISO 8601 with their offsets.")
    ]


@typed_config(ANSWER)
class Alert(TypedDict):
    """A run that started later than its job's lateness SLO, or a cron time without a success."""

    kind: AlertKind
    job: str
    runId: Annotated[
        str | None,
        Field(
            description="The late run; for a missed time, its run that failed or still "
            "waits, null when none was made."
        ),
    ]
    dueAt: Instant
    lateBySeconds: Annotated[float | None, Field(description="null for a missed time.")]
    sloSeconds: int
    owner: str
    runbookUrl: str
    message: str


@typed_config(ANSWER)
class AlertList(TypedDict):
    results: list[Alert]
    total: Annotated[int, Field(description="The window's alerts, on every page.")]
    next: Annotated[str | None, Field(description="The next page, or null on the last.")]
    unavailableShards: NotRequired[UnavailableShards]
