"""What the producer client answers: small frozen dataclasses built from the API's JSON.

Attributes are the answer's camelCase fields in snake_case (`runId` → `run_id`), instants are
aware datetimes, and `raw` keeps the whole answer (fields newer than this package included).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

if TYPE_CHECKING:
    from cronlease_client.errors import ApiError

T = TypeVar("T")
M = TypeVar("M", bound="Model")

# Field metadata: how to turn the JSON value into the attribute.
_CONVERT = "convert"
# Field metadata: not read from the JSON (a header's, set by the client).
_NOT_JSON = "not_json"
# A JSON type a required field must have: a Python type, or a tuple of them.
Kind = type | tuple[type, ...]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def parse_time(value: Any) -> datetime | None:
    """An ISO 8601 instant of the API (`2026-03-15T01:02:30Z`) as an aware datetime."""
    if not value:
        return None
    return datetime.fromisoformat(value)


def _time() -> Any:
    return field(default=None, metadata={_CONVERT: parse_time})


def _many(cls: type[Model]) -> Any:
    return field(
        default=(), metadata={_CONVERT: lambda items: tuple(cls.from_dict(i) for i in items or ())}
    )


@dataclass(frozen=True)
class Model:
    """An answer of the API: its fields as attributes, the JSON itself as `raw`."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # The JSON fields an answer of this model cannot lack, and their types. `parse` checks
    # them, so a body of another shape (a proxy's, another server's) is refused (BadAnswer)
    # rather than read as an empty model.
    required: ClassVar[tuple[tuple[str, Kind], ...]] = ()

    @classmethod
    def from_dict(cls: type[M], data: Mapping[str, Any]) -> M:
        values: dict[str, Any] = {"raw": dict(data)}
        for name, key, convert in _plan(cls):  # type: ignore[arg-type]  # (a class hashes)
            if key in data:
                values[name] = convert(data[key]) if convert else data[key]
        return cls(**values)

    @classmethod
    def parse(cls: type[M], data: Any) -> M:
        """Read an answer of the API as this model; TypeError when it is not of its shape."""
        if not isinstance(data, dict):
            raise TypeError(f"a {cls.__name__} is a JSON object, not {type(data).__name__}")
        for key, kind in cls.required:
            if not isinstance(data.get(key), kind):
                raise TypeError(f"a {cls.__name__} has no {key} of its type")
        return cls.from_dict(data)


@cache
def _plan(cls: type[Model]) -> tuple[tuple[str, str, Any], ...]:
    """A model's (attribute, JSON key, converter) triples, worked out once per class: doing it
    per answer was most of the cost of reading a batch of 1 000 runs."""
    return tuple(
        (spec.name, _camel(spec.name), spec.metadata.get(_CONVERT))
        for spec in fields(cls)
        if spec.name != "raw" and not spec.metadata.get(_NOT_JSON)
    )


@dataclass(frozen=True)
class Attempt(Model):
    """One lease of a run."""

    attempt: int = 0
    fencing_token: int = 0
    worker_id: str = ""
    leased_at: datetime | None = _time()
    last_heartbeat_at: datetime | None = _time()
    ended_at: datetime | None = _time()
    outcome: str | None = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Run(Model):
    """A run: one execution of a job. `attempts` is filled by `get_run` only."""

    required = (("runId", str), ("job", str), ("state", str))

    run_id: str = ""
    job: str = ""
    team: str | None = None
    queue: str = ""
    priority: str = ""
    state: str = ""
    attempt: int = 0
    max_attempts: int = 0
    due_at: datetime | None = _time()
    available_at: datetime | None = _time()
    idempotency_key: str = ""
    concurrency_key: str | None = None
    fencing_token: int | None = None
    lease_expires_at: datetime | None = _time()
    worker_id: str | None = None
    cancel_requested: bool = False
    trigger: str = ""
    dry_run: bool = False
    payload: Any = None
    result: Any = None
    last_error: dict[str, Any] | None = None
    created_at: datetime | None = _time()
    started_at: datetime | None = _time()
    finished_at: datetime | None = _time()
    attempts: tuple[Attempt, ...] = _many(Attempt)


@dataclass(frozen=True)
class RateLimit(Model):
    """At most `count` leases started in any window of `period_seconds` (a sliding window)."""

    required = (("count", int), ("periodSeconds", int))

    count: int = 0
    period_seconds: int = 0


def _rate_limit(value: Any) -> RateLimit | None:
    return None if value is None else RateLimit.parse(value)


@dataclass(frozen=True)
class Job(Model):
    """A job definition. `raw` is its JSON, which `put_job` and `apply_jobs` take back."""

    required = (("name", str), ("queue", str))

    name: str = ""
    schedule: dict[str, Any] = field(default_factory=dict)
    queue: str = ""
    priority: str = ""
    timeout_seconds: int = 0
    retry: dict[str, int] = field(default_factory=dict)
    concurrency: int | None = None
    concurrency_per_key: int | None = None
    concurrency_key_field: str = ""
    rate_limit: RateLimit | None = field(default=None, metadata={_CONVERT: _rate_limit})
    payload: Any = None
    paused: bool = False
    dry_run: bool = False
    lateness_slo_seconds: int | None = None
    owner: str = ""
    runbook_url: str = ""
    team: str = ""
    next_due_at: datetime | None = _time()
    shard: int = 0
    missed_runs_note: str = ""
    created_at: datetime | None = _time()
    updated_at: datetime | None = _time()
    # Its version, the ETag of the answer (get_job, put_job, pause_job, resume_job; "" in a
    # list): what `if_match` takes, to change the job only if nobody has since.
    version: str = field(default="", compare=False, metadata={_NOT_JSON: True})


@dataclass(frozen=True)
class FireTime(Model):
    """A fire time of a preview: `local` in the job's zone, `start` after its jitter."""

    required = (("utc", str),)

    local: datetime | None = _time()
    utc: datetime | None = _time()
    start: datetime | None = _time()
    note: str = ""


@dataclass(frozen=True)
class Queue(Model):
    """A queue of the team: its ready runs by priority (`depth`), its pause, and its rate
    limit (`rate_limit`, None without one) with the leases started in its window (`rate_used`)."""

    required = (("name", str), ("paused", bool))

    name: str = ""
    paused: bool = False
    depth: dict[str, int] = field(default_factory=dict)
    oldest_ready_at: datetime | None = _time()
    last_leased_at: datetime | None = _time()
    last_worker_id: str = ""
    rate_limit: RateLimit | None = field(default=None, metadata={_CONVERT: _rate_limit})
    rate_used: int | None = None


@dataclass(frozen=True)
class SyncChange(Model):
    """One change of `apply_jobs`; `fields` ({name: {"before", "after"}}) for updates."""

    action: str = ""
    name: str = ""
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    applied: bool = False


@dataclass(frozen=True)
class SyncResult(Model):
    """What `apply_jobs` changed (or, with `dry_run`, would change)."""

    required = (("changes", list), ("applied", bool))

    changes: tuple[SyncChange, ...] = _many(SyncChange)
    summary: dict[str, int] = field(default_factory=dict)
    applied: bool = False
    # False when a database failed at its commit after others had committed: the changes whose
    # `applied` is False were not made (apply_jobs raises SyncIncomplete, after its retries).
    complete: bool = True
    detail: str = ""


@dataclass(frozen=True)
class DlqResult(Model):
    """How many dead runs a requeue or discard changed, and which."""

    required = (("count", int), ("runIds", list))

    count: int = 0
    run_ids: tuple[str, ...] = field(default=(), metadata={_CONVERT: tuple})
    # Answered 207: the shards whose database could not be reached; their runs were not
    # changed (the same call again changes them).
    unavailable_shards: tuple[str, ...] = field(default=(), metadata={_CONVERT: tuple})


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list; `next` is the address of the following one (None on the last)."""

    items: tuple[T, ...]
    next: str | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Enqueue:
    """One run to create: `delay` (seconds or a timedelta) or `run_at` (an aware datetime or an
    ISO string), neither for now. Without an `idempotency_key` the client makes one, so a retry
    of the request cannot create the run twice."""

    job: str
    payload: Any = None
    delay: float | timedelta | None = None
    run_at: datetime | str | None = None
    idempotency_key: str | None = None
    priority: str | None = None
    concurrency_key: str | None = None

    def to_json(self, key: str) -> dict[str, Any]:
        """The item of `POST /api/v1/runs`, with `key` as the idempotency key; InvalidItem (a
        ValueError) naming the field when the item cannot be sent."""
        if self.delay is not None and self.run_at is not None:
            reason = "give either delay or run_at, not both"
            raise InvalidItem({"delay": reason, "run_at": reason})
        item: dict[str, Any] = {"job": self.job, "idempotencyKey": key}
        if self.delay is not None:
            if isinstance(self.delay, timedelta):
                seconds: float = self.delay.total_seconds()
            elif isinstance(self.delay, int | float) and not isinstance(self.delay, bool):
                seconds = self.delay
            else:
                raise InvalidItem({"delay": "delay must be a number of seconds or a timedelta"})
            if not math.isfinite(seconds):
                raise InvalidItem({"delay": "delay must be a finite number of seconds"})
            if seconds < 0:
                raise InvalidItem({"delay": "delay cannot be negative"})
            # Whole seconds, rounded up: a run is never due before the delay asked for.
            item["delaySeconds"] = math.ceil(seconds)
        if isinstance(self.run_at, datetime):
            if self.run_at.tzinfo is None:
                reason = "run_at must be an aware datetime (with a time zone)"
                raise InvalidItem({"run_at": reason})
            item["runAt"] = self.run_at.isoformat()
        elif self.run_at is not None:
            item["runAt"] = self.run_at
        for name, key in _OPTIONAL_ITEM_FIELDS:
            value = getattr(self, name)
            if value is not None:
                item[key] = value
        return item


class InvalidItem(ValueError):
    """An item the client will not send: a reason by field (the argument's name)."""

    def __init__(self, reasons: Mapping[str, str]) -> None:
        super().__init__("; ".join(dict.fromkeys(reasons.values())))
        self.errors = {name: [reason] for name, reason in reasons.items()}


# Spelled once: camel-casing each name per item was a fifth of a 1 000-run batch's client CPU.
_OPTIONAL_ITEM_FIELDS = tuple(
    (name, _camel(name)) for name in ("payload", "priority", "concurrency_key")
)


@dataclass(frozen=True)
class EnqueueResult:
    """One item of `enqueue_many`: `status` 201 (created) or 200 (the run that key already
    made) with its `run_id` and `run` (None when asked for ids only), or an error status (400,
    404, 409, 413) with `error`, never raised. `idempotency_key` is the key sent (the one made
    up when the item had none)."""

    status: int
    idempotency_key: str
    error: ApiError | None = None
    run_id: str | None = None
    # The run's JSON; `run` builds it on first use. Building 1 000 Runs took a producer as
    # long as sending them, and a producer that only checks `ok` never needs them.
    run_json: Mapping[str, Any] | None = field(default=None, repr=False)

    @cached_property
    def run(self) -> Run | None:
        return None if self.run_json is None else Run.from_dict(self.run_json)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def created(self) -> bool:
        return self.status == 201
