"""The management API's job shapes: definitions (POST, PUT, PATCH, jobs as code), previews and
the sync of a team's definitions. The same models validate the dashboard's edit form and the
`apply` command's files."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, NotRequired

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import URLValidator
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidationInfo,
    WithJsonSchema,
    create_model,
    field_validator,
)
from pydantic import ValidationError as PydanticError
from pydantic import with_config as typed_config
from pydantic_core import InitErrorDetails
from typing_extensions import TypeAliasType, TypedDict

from apps.api.shapes import (
    ANSWER,
    Body,
    Instant,
    UnavailableShards,
    field_errors,
    json_value,
    name_check,
    problem,
)
from apps.api.shapes.worker import JobName, QueueName
from apps.jobs import schedule as sched
from apps.jobs.services import DefinitionSpec
from apps.jobs.sync import InvalidEntry
from apps.runs import limits
from apps.runs.clock import read_iso
from apps.runs.models import PRIORITIES

# Every value of a body parsed outside a request (the edit form, an `apply` file) is measured
# against the payload cap: there is no body size to spare the walk.
UNMEASURED = 2**62

PriorityEnum = TypeAliasType("PriorityEnum", Literal["critical", "default", "bulk"])


def _ref_beside_siblings(schema: dict[str, Any]) -> None:
    """OpenAPI 3.0 ignores the siblings of a $ref (a default, a description): wrap it."""
    if "$ref" in schema:
        schema["allOf"] = [{"$ref": schema.pop("$ref")}]


def no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


SCHEDULE_SCHEMA: dict[str, Any] = {
    "description": (
        "One of: cron (`cron` with optional `timeZone`, `jitterSeconds`, `missedRunPolicy`, "
        "`startAt`, `endAt`, `overlapPolicy`), "
        "one-off (`runAt`), delayed (`delaySeconds`), or `{}` for runs only triggered through "
        "the API or the dashboard."
    ),
    "oneOf": [
        {
            "type": "object",
            "description": "Cron: at each time a 5-field expression matches, in a time zone.",
            "properties": {
                "cron": {
                    "type": "string",
                    "minLength": 1,
                    "description": "5 fields (minute hour day-of-month month day-of-week) "
                    "or a macro such as `@daily`; `L`, `LW`, `nW` in day of month, `dL`, `d#n` "
                    "in day of week.",
                    "example": "0 2 * * *",
                },
                "timeZone": {
                    "type": "string",
                    "default": "UTC",
                    "description": "An IANA time zone name.",
                    "example": "Europe/Berlin",
                },
                "jitterSeconds": {
                    "type": "integer",
                    "minimum": 0,
                    "default": 60,
                    "description": "Spread the start by a stable per-job offset below this "
                    "many seconds; 0 turns it off. At most the shortest gap between fire times on the "
                    "wall clock.",
                },
                "missedRunPolicy": {
                    "type": "string",
                    "enum": list(sched.MISSED_RUN_POLICIES),
                    "default": sched.DEFAULT_MISSED_RUN_POLICY,
                    "description": "What to do with fire times missed during an outage.",
                },
                "startAt": {
                    "type": "string",
                    "format": "date-time",
                    "nullable": True,
                    "description": "No fire time before this instant (with an offset or Z); "
                    "a fire time exactly at it runs.",
                },
                "endAt": {
                    "type": "string",
                    "format": "date-time",
                    "nullable": True,
                    "description": "No fire time after this instant (with an offset or Z); "
                    "a fire time exactly at it runs. After startAt.",
                },
                "overlapPolicy": {
                    "type": "string",
                    "enum": list(sched.OVERLAP_POLICIES),
                    "default": sched.DEFAULT_OVERLAP_POLICY,
                    "description": "What a fire time does while runs of the job are waiting "
                    "(scheduled, ready, retrying) or leased, whatever created them: `allow_all` "
                    "a new run anyway; `skip` no new run; `buffer_one` no new run while one is "
                    "waiting; `cancel_other` a new run, and the others are cancelled (waiting) "
                    "or asked to stop (leased).",
                },
            },
            "required": ["cron"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "description": "One-off: one run at a time.",
            "properties": {
                "runAt": {
                    "type": "string",
                    "format": "date-time",
                    "description": "One run at this time (with an offset or Z).",
                }
            },
            "required": ["runAt"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "description": "Delayed: one run, some time after the definition's creation.",
            "properties": {
                "delaySeconds": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": sched.MAX_DELAY_SECONDS,
                    "description": "One run, this long after the definition's creation.",
                }
            },
            "required": ["delaySeconds"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "description": "None: runs only when triggered.",
            "properties": {},
            "maxProperties": 0,
            "additionalProperties": False,
        },
    ],
}
# The schedule's rules live in apps.jobs.schedule (parse_schedule); this names its JSON form.
ScheduleJSON = TypeAliasType("Schedule", Annotated[Any, WithJsonSchema(SCHEDULE_SCHEMA)])


def schedule_value(value: Any) -> dict:
    """A schedule in its canonical JSON form, or its reasons as errors under `schedule.…`."""
    try:
        parsed = sched.parse_schedule(value)
    except sched.ScheduleError as exc:
        raise errors_within(
            {key.removeprefix("schedule").lstrip("."): [r] for key, r in exc.errors.items()},
            value,
        ) from None
    if isinstance(parsed, sched.OneOffSchedule) and parsed.run_at > limits.LATEST_RUN_TIME:
        raise errors_within({"runAt": ["Later than 9999-01-01T00:00:00Z."]}, value)
    return sched.schedule_to_json(parsed)


def errors_within(errors: dict[str, list[str]], value: Any) -> PydanticError:
    """Errors at paths inside the field being validated ("" for the field itself)."""
    return PydanticError.from_exception_data(
        "field",
        [
            InitErrorDetails(
                type=problem("invalid", reason), loc=(path,) if path else (), input=value
            )
            for path, reasons in errors.items()
            for reason in reasons
        ],
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str) -> str:
    # PostgreSQL text cannot hold NUL, and a lone surrogate cannot be encoded. (A regular
    # expression: testing each character in Python took 8 ms of a 1 000-run enqueue.)
    if "\x00" in value:
        raise problem("null_characters", "Null characters are not allowed.")
    if not value.isascii() and _SURROGATE.search(value):
        raise problem("surrogates", "Surrogate characters are not allowed.")
    return value


Checked = AfterValidator(_text)
Text = Annotated[str, Checked]
_url = URLValidator()


def _url_or_blank(value: str) -> str:
    if value:
        try:
            _url(value)
        except DjangoValidationError:
            raise problem("url", "Enter a valid URL.") from None
    return value


READ_ONLY = "Read-only: accepted and ignored, so a fetched definition can be sent back."
Ignored = Annotated[Any, Field(None, description=READ_ONLY)]


def _instant(value: Any) -> Any:
    """An ISO 8601 time with an offset or Z, e.g. 2026-12-01T10:00:00Z (a datetime passes)."""
    if value is None or isinstance(value, datetime):
        return value
    parsed = read_iso(value)
    if parsed is None:
        raise problem("datetime", "Give an ISO 8601 time with an offset or Z.")
    if parsed.tzinfo is None:
        raise problem("datetime", "Give an offset or Z, e.g. 2026-12-01T10:00:00Z.")
    # In UTC: PostgreSQL refuses offsets past ±15:59 that Python reads (a 500 before).
    try:
        return parsed.astimezone(UTC)
    except OverflowError:  # out of range once in UTC
        raise problem("datetime", "Out of range once in UTC.") from None


AwareTime = Annotated[datetime | None, BeforeValidator(_instant)]


def after(value: Any) -> datetime | None:
    """A preview's `from`: blank means now, as when it is left out; a time in the years 2 to
    9998 (the search for fire times steps a day past either end of Python's calendar)."""
    instant = _instant(None if value == "" else value)
    if instant is not None and not 2 <= instant.year <= 9998:
        raise problem("datetime", "A time between the years 2 and 9998.")
    return instant


After = Annotated[datetime | None, BeforeValidator(after)]


# --- requests ---------------------------------------------------------------------------------


class Retry(Body):
    """The retry policy: attempts, and the full-jitter exponential backoff between them
    (`maxSeconds` ≥ `baseSeconds`)."""

    maxAttempts: int = Field(3, ge=1, le=1000)
    baseSeconds: int = Field(30, ge=0, le=86400)
    maxSeconds: int = Field(1800, ge=0, le=7 * 86400, validate_default=True)

    @field_validator("maxSeconds")
    @classmethod
    def _at_least_base(cls, value: int, info: ValidationInfo) -> int:
        base = info.data.get("baseSeconds")
        if base is not None and value < base:
            raise problem("backoff", "Must be at least baseSeconds.")
        return value


class RateLimit(Body):
    """At most `count` leases started in any window of `periodSeconds` (a sliding window)."""

    count: int = Field(ge=1, le=1_000_000)
    periodSeconds: int = Field(ge=1, le=7 * 86400)


class Definition(Body):
    """A job definition; omitted fields take their defaults."""

    name: JobName
    schedule: ScheduleJSON = Field(default_factory=dict)
    queue: QueueName = "default"
    priority: PriorityEnum = Field("default", json_schema_extra=_ref_beside_siblings)
    timeoutSeconds: int = Field(3600, ge=1, le=7 * 86400)
    retry: Retry = Field(default_factory=Retry)
    concurrency: int | None = Field(None, ge=1, le=100000)
    concurrencyPerKey: int | None = Field(None, ge=1, le=100000)
    concurrencyKeyField: Text = Field(
        "",
        max_length=100,
        description="The payload field whose value is the concurrency key of a run that is "
        "given none (cron runs).",
    )
    rateLimit: RateLimit | None = None
    payload: Any = Field(
        default_factory=dict,
        json_schema_extra=lambda schema: schema.update(
            anyOf=[
                {"type": "object", "additionalProperties": True},
                {"type": "array", "items": {}},
                {"type": "string"},
                {"type": "number"},
                {"type": "boolean"},
            ],
            description="Any JSON value except null; over the payload cap it is a 413.",
        ),
    )
    paused: bool = False
    dryRun: bool = False
    latenessSloSeconds: int | None = Field(None, ge=1, le=7 * 86400)
    owner: Text = Field("", max_length=200)
    runbookUrl: Annotated[
        str,
        AfterValidator(_url_or_blank),
        WithJsonSchema(
            {
                "oneOf": [
                    {"type": "string", "format": "uri", "maxLength": 500},
                    {"type": "string", "maxLength": 0},
                ],
                "default": "",
            }
        ),
    ] = Field("", max_length=500)
    # What a fetched definition carries besides: accepted, so it can be sent back, and ignored.
    team: Ignored
    nextDueAt: Ignored
    shard: Ignored
    createdAt: Ignored
    updatedAt: Ignored
    missedRunsNote: Ignored

    _schedule = field_validator("schedule")(schedule_value)

    @field_validator("concurrencyKeyField")
    @classmethod
    def _key_field_needs_a_limit(cls, value: str, info: ValidationInfo) -> str:
        if value and info.data.get("concurrencyPerKey") is None:
            raise problem("key_field", "Needs concurrencyPerKey: a key limits nothing alone.")
        return value

    @field_validator("payload")
    @classmethod
    def _payload(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            raise problem("null", "This field may not be null.")
        return json_value(value, info)

    def to_spec(self) -> DefinitionSpec:
        return DefinitionSpec(
            name=self.name,
            schedule=self.schedule,
            queue=self.queue,
            priority=PRIORITIES[self.priority],
            timeout_seconds=self.timeoutSeconds,
            retry_max_attempts=self.retry.maxAttempts,
            retry_base_seconds=self.retry.baseSeconds,
            retry_max_seconds=self.retry.maxSeconds,
            concurrency=self.concurrency,
            payload=self.payload,
            paused=self.paused,
            dry_run=self.dryRun,
            lateness_slo_seconds=self.latenessSloSeconds,
            owner=self.owner,
            runbook_url=self.runbookUrl,
            concurrency_per_key=self.concurrencyPerKey,
            concurrency_key_field=self.concurrencyKeyField,
            rate_limit_count=self.rateLimit.count if self.rateLimit else None,
            rate_limit_period_seconds=self.rateLimit.periodSeconds if self.rateLimit else None,
            keeps=frozenset(
                field for field, name in _SWITCHES.items() if name not in self.model_fields_set
            ),
        )


# The switches a body may leave unsaid for a replacement to keep (DefinitionSpec.keeps).
_SWITCHES = {"paused": "paused", "dry_run": "dryRun"}


class DefinitionReplace(Definition):
    """The definition for PUT: the name comes from the path (a name in the body must match it),
    and the queue is stated (an empty body would otherwise reset a job to every default)."""

    name: Annotated[str, AfterValidator(name_check(limits.job_name_problem))] = Field(  # type: ignore[assignment]
        None,
        json_schema_extra=lambda schema: (
            no_default(schema),
            schema.update(pattern=limits.JOB_NAME_RE.pattern, maxLength=limits.JOB_NAME_MAX),
        ),
    )
    queue: QueueName  # type: ignore[assignment]


class DefinitionEntry(Definition):
    """One job of a jobs-as-code file or sync: it states the definition, as a PUT does, so the
    queue is stated (an entry of a name alone moved a job to queue `default`, schedule and
    limits dropped)."""

    queue: QueueName  # type: ignore[assignment]


def _patch_of(model: type[Body], name: str, doc: str) -> type[Body]:
    """`model`'s fields, each optional and without a default: the body of a PATCH, which the
    view merges into the stored definition and then validates whole as `model`."""
    fields: dict[str, Any] = {}
    for key, info in model.model_fields.items():
        annotation = info.rebuild_annotation()
        if isinstance(info.annotation, type) and issubclass(info.annotation, Body):
            annotation = _patch_of(info.annotation, f"{info.annotation.__name__}Patch", "")
        extra = info.json_schema_extra

        def schema_extra(schema: dict[str, Any], extra=extra) -> None:
            if callable(extra):
                extra(schema)
            elif extra:
                schema.update(extra)
            schema.pop("default", None)
            _ref_beside_siblings(schema)

        fields[key] = (
            annotation,
            Field(None, description=info.description, json_schema_extra=schema_extra),
        )
    return create_model(name, __base__=Body, __doc__=doc or model.__doc__, **fields)


# Named after the model it loosens: drf-spectacular calls the body of a PATCH
# "Patched<name>Request", here PatchedDefinitionRequest.
DefinitionPatch = _patch_of(
    Definition,
    "Definition",
    "The fields to change; the others keep their values (`retry` is merged field by field).",
)


def parse_definition(entry: Any, shape: type[Definition] = Definition) -> DefinitionSpec:
    """Validate one definition (the edit form; a jobs file's entry as `DefinitionEntry`, by
    `parse_entry`); raise InvalidEntry naming every bad field, or PayloadTooLarge."""
    try:
        body = shape.model_validate(entry, context={"body_size": UNMEASURED})
    except PydanticError as exc:
        raise InvalidEntry(field_errors(exc)) from None
    return body.to_spec()


def parse_entry(entry: Any) -> DefinitionSpec:
    """A jobs file's entry (`manage.py apply`), as a sync's."""
    return parse_definition(entry, DefinitionEntry)


class SyncRequest(Body):
    """The team's definitions, as kept in its repository."""

    jobs: list[DefinitionEntry]
    prune: bool = Field(False, description="Delete the team's definitions not listed.")
    dryRun: bool = Field(False, description="Answer the diff; change nothing.")


class SchedulePreview(Body):
    """A schedule to preview; `name` sets the jitter."""

    name: JobName = "preview"
    schedule: ScheduleJSON
    count: int = Field(10, ge=1, le=1000)
    after: After = Field(
        None,
        alias="from",
        description="Show fire times strictly after this time (with an offset or Z); default now.",
    )

    _schedule = field_validator("schedule")(schedule_value)


# --- answers ----------------------------------------------------------------------------------


@typed_config(ANSWER)
class RetryPolicy(TypedDict):
    maxAttempts: Annotated[int, Field(ge=1, le=1000)]
    baseSeconds: Annotated[int, Field(ge=0, le=86400)]
    maxSeconds: Annotated[int, Field(ge=0, le=7 * 86400)]


@typed_config(ANSWER)
class RateLimitAnswer(TypedDict):
    count: Annotated[int, Field(ge=1)]
    periodSeconds: Annotated[int, Field(ge=1)]


@typed_config(ANSWER)
class DefinitionAnswer(TypedDict):
    """A job definition."""

    name: str
    schedule: Annotated[
        ScheduleJSON,
        Field(
            description="The schedule, with its defaults filled in.",
            json_schema_extra=_ref_beside_siblings,
        ),
    ]
    queue: str
    priority: PriorityEnum
    timeoutSeconds: Annotated[int, Field(ge=1)]
    retry: RetryPolicy
    concurrency: Annotated[
        int | None, Field(ge=1, description="Max leased runs at once; null = unlimited.")
    ]
    concurrencyPerKey: Annotated[
        int | None,
        Field(ge=1, description="Max leased runs at once per concurrency key; null = unlimited."),
    ]
    concurrencyKeyField: str
    rateLimit: RateLimitAnswer | None
    payload: Any
    paused: bool
    dryRun: bool
    latenessSloSeconds: Annotated[int | None, Field(ge=1)]
    owner: Annotated[str, Field(description="Who to contact when it fails.")]
    runbookUrl: str
    team: Annotated[str, Field(description="The slug of the owning team.")]
    nextDueAt: Instant | None
    shard: Annotated[int, Field(ge=0)]
    missedRunsNote: Annotated[
        str, Field(description="What the last catch-up after an outage did, if anything.")
    ]
    createdAt: Instant
    updatedAt: Instant


@typed_config(ANSWER)
class DefinitionList(TypedDict):
    results: list[DefinitionAnswer]
    unavailableShards: NotRequired[UnavailableShards]


@typed_config(ANSWER)
class FireTime(TypedDict):
    local: Annotated[
        str,
        Field(
            description="The nominal fire time in the definition's zone, ISO 8601 with its offset."
        ),
    ]
    utc: Annotated[Instant, Field(description="The same instant in UTC.")]
    start: Annotated[Instant, Field(description="The instant after the job's jitter.")]
    note: Annotated[
        str,
        Field(
            description="Empty unless a DST change moved or repeated this time, or it is the "
            "schedule's first run (its startAt still ahead) or its last (before its endAt)."
        ),
    ]


@typed_config(ANSWER)
class Preview(TypedDict):
    times: list[FireTime]


@typed_config(ANSWER)
class FieldChange(TypedDict):
    before: Any
    after: Any


@typed_config(ANSWER)
class SyncChange(TypedDict):
    action: Literal["create", "update", "delete"]
    name: str
    applied: Annotated[
        bool, Field(description="Made (false in a dry run, and for a change not made: `complete`).")
    ]
    fields: NotRequired[
        Annotated[dict[str, FieldChange], Field(description="For updates: what changed.")]
    ]


@typed_config(ANSWER)
class SyncSummary(TypedDict):
    create: int
    update: int
    delete: int
    unchanged: int


@typed_config(ANSWER)
class SyncAnswer(TypedDict):
    changes: list[SyncChange]
    summary: SyncSummary
    applied: bool
    complete: Annotated[
        bool,
        Field(
            description="False when a database failed at its commit after others had committed "
            "(a sync is not two-phase): the changes with `applied` false were not made. The same "
            "body sent again makes them (answered 207, with `detail` and `Retry-After`)."
        ),
    ]
    detail: NotRequired[str]
