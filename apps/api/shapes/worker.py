"""The worker protocol's shapes: lease, heartbeat, complete, fail, and their batches."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from django.conf import settings
from pydantic import AfterValidator, Field, field_validator
from pydantic import with_config as typed_config
from typing_extensions import TypedDict  # pydantic reads only this one on Python 3.11

from apps.api.shapes import ANSWER, Body, Instant, json_value, name_check, problem
from apps.runs import limits
from apps.runs.ids import parse_run_id

BIGINT = 2**63 - 1  # every integer here meets a PostgreSQL bigint (fencing tokens above all)
STACK_MAX_CHARS = limits.STACK_MAX_CHARS

QueueName = Annotated[
    str,
    AfterValidator(name_check(limits.queue_name_problem)),
    Field(json_schema_extra={"pattern": limits.QUEUE_NAME_RE.pattern, "maxLength": 100}),
]
JobName = Annotated[
    str,
    AfterValidator(name_check(limits.job_name_problem)),
    Field(json_schema_extra={"pattern": limits.JOB_NAME_RE.pattern, "maxLength": 200}),
]
WorkerId = Annotated[
    str,
    AfterValidator(name_check(limits.worker_id_problem)),
    Field(json_schema_extra={"pattern": limits.WORKER_ID_RE.pattern, "maxLength": 200}),
]
RunId = Annotated[
    str, Field(min_length=1, max_length=40, description="A run's public id, `run_…`.")
]
FencingToken = Annotated[
    int,
    Field(
        ge=1,
        le=BIGINT,
        description="The lease's token; an older one is refused with 409 and changes nothing.",
    ),
]
Priority = Literal["critical", "default", "bulk"]
RunState = Literal["scheduled", "ready", "leased", "succeeded", "retrying", "dead", "cancelled"]
# One set of item statuses for every batch answer, worker and enqueue alike (the schema names
# each choice set once); each answer's description says which it uses.
ItemStatus = Literal[200, 201, 400, 404, 409, 413, 503]


# --- requests ---------------------------------------------------------------------------------


def _at_most(value: int, limit: int) -> int:
    if value > limit:
        raise problem("too_large", f"Ensure this value is less than or equal to {limit}.")
    return value


class TokenBody(Body):
    """A lease's fencing token (heartbeat)."""

    fencingToken: FencingToken


class CompleteBody(TokenBody):
    result: Any = Field(None, description="Anything JSON; kept with the run.")

    _result = field_validator("result")(json_value)


class ErrorBody(Body):
    """What went wrong, as the worker saw it."""

    message: str = Field("", max_length=10000)
    type: str = Field("", max_length=200)
    stack: str | None = Field(
        None,
        description=(
            "The stack trace, kept with the run's last error and the attempt; past "
            "65 536 characters (64 KB) it is cut, keeping its end (where the error is) under "
            "a line saying how much was cut, rather than refusing the report."
        ),
    )
    # Accepted and not kept: older SDKs send them.
    traceback: Any = None
    details: Any = None


class FailBody(TokenBody):
    error: ErrorBody = Field(default_factory=ErrorBody)
    retryable: bool = Field(
        True, description="false sends the run to the dead-letter queue at once."
    )


class HeartbeatItem(TokenBody):
    runId: RunId


class HeartbeatBatch(Body):
    leases: list[HeartbeatItem] = Field(min_length=1, max_length=1000)

    def problems(self) -> dict[str, list[str]]:
        return _repeats("leases", [item.runId for item in self.leases])


class ResultItem(TokenBody):
    runId: RunId
    outcome: Literal["succeeded", "failed"]
    result: Any = None
    # No default_factory: building an empty ErrorBody for every succeeded item was half the
    # cost of validating a batch (179 µs against 88 µs for 100 items, measured here).
    error: ErrorBody | None = Field(None, description="With a `failed` outcome: what went wrong.")
    retryable: bool = True

    _result = field_validator("result")(json_value)


class ResultBatch(Body):
    results: list[ResultItem] = Field(min_length=1, max_length=1000)

    def problems(self) -> dict[str, list[str]]:
        return _repeats("results", [item.runId for item in self.results]) | _mismatched(
            self.results
        )


class LeaseRequest(Body):
    """Claim up to `max` ready runs of these queues (and jobs) for this worker."""

    queues: list[QueueName] = Field(min_length=1, max_length=100)
    jobs: list[JobName] | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="Only runs of these jobs (a Celery bridge that has tasks for some jobs).",
    )
    max: int = Field(
        1,
        ge=1,
        json_schema_extra=lambda schema: schema.update(maximum=settings.SCHEDULER_MAX_CLAIM),
    )
    workerId: WorkerId
    leaseSeconds: int = Field(
        default_factory=lambda: settings.SCHEDULER_DEFAULT_LEASE_SECONDS,
        ge=1,
        le=86400,
        description="The lease's length; `SCHEDULER_DEFAULT_LEASE_SECONDS` when not given.",
    )
    waitSeconds: int = Field(
        0,
        ge=0,
        description="Long-poll this long when nothing is ready.",
        json_schema_extra=lambda schema: schema.update(maximum=settings.SCHEDULER_MAX_WAIT_SECONDS),
    )

    results: list[ResultItem] | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description=(
            "Finished runs' outcomes, the items of `POST /api/v1/results`: applied first, "
            "with the same rules and a status each in the answer's `results`, so a worker "
            "reports and asks for more in one request. An error that stops them being applied "
            "answers the whole request with it and leases nothing."
        ),
    )

    @field_validator("max")
    @classmethod
    def _max(cls, value: int) -> int:
        return _at_most(value, settings.SCHEDULER_MAX_CLAIM)

    @field_validator("queues", "jobs")
    @classmethod
    def _once_each(cls, names: list[str] | None) -> list[str] | None:
        # A queue named twice was claimed from twice, each pass counting the other's leases
        # against the jobs' limits: a worker got 3 of the 5 runs a concurrency of 5 allowed.
        return None if names is None else list(dict.fromkeys(names))

    def problems(self) -> dict[str, list[str]]:
        results = self.results or []
        return _repeats("results", [item.runId for item in results]) | _mismatched(results)

    @field_validator("waitSeconds")
    @classmethod
    def _wait(cls, value: int) -> int:
        return _at_most(value, settings.SCHEDULER_MAX_WAIT_SECONDS)


def _repeats(field: str, run_ids: list[str]) -> dict[str, list[str]]:
    """One run, one item: a batch naming a run twice is refused (each item has one answer, and
    a repeated id would multiply the work, and the audit of a denied one)."""
    seen: set[int | str] = set()
    faults = {}
    for index, run_id in enumerate(run_ids):
        # By the run it names: an id's digits may be written in either case.
        run = parse_run_id(run_id) or run_id
        if run in seen:
            faults[f"{field}[{index}].runId"] = [f"{run_id} appears earlier in this batch."]
        seen.add(run)
    return faults


def _mismatched(results: list[ResultItem]) -> dict[str, list[str]]:
    """An item's fields must fit its outcome, as the single calls' bodies must (`complete`
    takes no `error`, `fail` no `result`): a field that would be dropped unread is refused."""
    faults = {}
    for index, item in enumerate(results):
        given = item.model_fields_set
        if item.outcome == "succeeded":
            for name in ("error", "retryable"):
                if name in given:
                    faults[f"results[{index}].{name}"] = ["Only with a failed outcome."]
        elif "result" in given:
            faults[f"results[{index}].result"] = ["Only with a succeeded outcome."]
    return faults


# --- answers ----------------------------------------------------------------------------------


@typed_config(ANSWER)
class Lease(TypedDict):
    """A leased run, handed to a worker."""

    runId: str
    job: str
    attempt: int
    idempotencyKey: str
    fencingToken: Annotated[
        int, Field(description="Carry it on heartbeat, complete and fail; an older one gets 409.")
    ]
    leaseExpiresAt: Instant
    payload: Any
    queue: str
    priority: Priority
    maxAttempts: int
    dueAt: Instant
    dryRun: bool


@typed_config(ANSWER)
class HeartbeatAnswer(TypedDict):
    runId: str
    leaseExpiresAt: Instant


@typed_config(ANSWER)
class CompleteAnswer(TypedDict):
    runId: str
    state: Annotated[RunState, Field(description="`succeeded`.")]


@typed_config(ANSWER)
class FailAnswer(TypedDict):
    runId: str
    state: Annotated[RunState, Field(description="`retrying` (attempts left) or `dead` (the DLQ).")]
    availableAt: Annotated[
        Instant | None, Field(description="When the retry may be claimed; null unless `retrying`.")
    ]


@typed_config(ANSWER)
class ItemRefused(TypedDict):
    """An item of a batch that changed nothing, as the single call's problem details: 404 (no
    such run), 409 (stale token, not leased) or 503 (the run's shard is unavailable)."""

    runId: str
    type: Annotated[
        str,
        Field(
            description="The single call's problem type: ending in `/conflict` for a stale "
            "token or a run no longer leased, `/cancelled` when a cancel of the run was asked "
            "for (stop, then report), `/not-found`, `/shard-unavailable`."
        ),
    ]
    title: str
    status: Annotated[
        ItemStatus, Field(description="404, 409, or 503 when the run's shard is unavailable.")
    ]
    detail: str
    state: NotRequired[
        Annotated[
            RunState,
            Field(
                description="On a 409 for the run's current fencing token whose lease a "
                "reported outcome ended: the state it ended in (`succeeded` when a success was "
                "recorded before, say). Absent otherwise (a stale token, an expired lease)."
            ),
        ]
    ]


@typed_config(ANSWER)
class HeartbeatDone(TypedDict):
    runId: str
    status: Annotated[ItemStatus, Field(description="200.")]
    leaseExpiresAt: Instant


@typed_config(ANSWER)
class ResultDone(TypedDict):
    runId: str
    status: Annotated[ItemStatus, Field(description="200.")]
    state: Annotated[RunState, Field(description="`succeeded`, `retrying` or `dead`.")]
    availableAt: Annotated[Instant | None, Field(description="When the retry may be claimed.")]


@typed_config(ANSWER)
class HeartbeatBatchAnswer(TypedDict):
    leases: Annotated[
        list[HeartbeatDone | ItemRefused], Field(description="One answer per item, in order.")
    ]


@typed_config(ANSWER)
class ResultBatchAnswer(TypedDict):
    results: Annotated[
        list[ResultDone | ItemRefused], Field(description="One answer per item, in order.")
    ]


@typed_config(ANSWER)
class LeaseList(TypedDict):
    leases: list[Lease]
    results: NotRequired[
        Annotated[
            list[ResultDone | ItemRefused],
            Field(description="When the request carried `results`: one answer per item, in order."),
        ]
    ]
