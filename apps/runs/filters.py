"""The filter of a bulk action (requeue, discard, retry): what it may say, and what it selects.

A bulk action's filter never widens by accident. Every field is a non-empty value of its type;
`null`, `""`, `false` and `[]` are errors, not "match anything" (a discard with
`{"job": null}` once emptied a team's whole dead-letter queue), and an empty filter is an error
too. Acting on everything is said outright: `{"all": true}`.

The API's filters say job, queue and since; the dashboard's also say a due window, a text of
the error and an error group (`fingerprint`, apps/runs/fingerprints.py). What a filter selects
is said twice, once per caller's need: `apply` (a queryset, the API's selection by filter) and
`where` (SQL conditions, the dashboard's count and its one statement per shard database).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db.models import Q, QuerySet

from apps.runs import fingerprints, limits, shards
from apps.runs.clock import format_utc, read_iso

FIELDS = ("job", "queue", "since", "all")
ISO_RULE = "Give an ISO 8601 time with an offset or Z."


class FilterError(ValueError):
    """`errors` maps "filter.job" to its reasons."""

    def __init__(self, errors: dict[str, list[str]]) -> None:
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))
        self.errors = errors


@dataclass(frozen=True)
class BulkFilter:
    job: str | None = None
    queue: str | None = None
    since: datetime | None = None  # created at or after
    everything: bool = False
    # The dashboard's list filters (not the API's): due at or after / before, a text the last
    # error's message or type contains, and the last error's group.
    due_from: datetime | None = None
    due_to: datetime | None = None
    error: str | None = None
    fingerprint: int | None = None
    # Failed at or before: a confirmed action acts on the failures its confirmation counted,
    # not on runs that failed while the person read it.
    failed_by: datetime | None = None

    def as_json(self) -> dict[str, Any]:
        """The filter as the caller gave it (for the audit trail)."""
        answer: dict[str, Any] = {"all": True} if self.everything else {}
        if self.job is not None:
            answer["job"] = self.job
        if self.queue is not None:
            answer["queue"] = self.queue
        if self.since is not None:
            answer["since"] = format_utc(self.since)
        if self.due_from is not None:
            answer["dueFrom"] = format_utc(self.due_from)
        if self.due_to is not None:
            answer["dueBefore"] = format_utc(self.due_to)
        if self.error is not None:
            answer["error"] = self.error
        if self.fingerprint is not None:
            answer["group"] = fingerprints.to_hex(self.fingerprint)
        if self.failed_by is not None:
            answer["failedBy"] = format_utc(self.failed_by)
        return answer

    def where(self) -> tuple[str, dict[str, Any]]:
        """SQL conditions on `runs_run r` that select what this filter does, and their
        parameters (named `filter_…`). `everything` adds none: the caller's team and state
        conditions still hold."""
        conditions: list[str] = []
        params: dict[str, Any] = {}
        if self.job is not None:
            # A job's name is unique (job_team_name): no row, no run.
            conditions.append(
                "r.definition_id = (SELECT id FROM jobs_jobdefinition WHERE name = %(filter_job)s)"
            )
            params["filter_job"] = self.job
        for column, key, value in (
            ("queue", "filter_queue", self.queue),
            ("error_fingerprint", "filter_fingerprint", self.fingerprint),
        ):
            if value is not None:
                conditions.append(f"r.{column} = %({key})s")
                params[key] = value
        for condition, key, value in (
            ("r.created_at >= %(filter_since)s", "filter_since", self.since),
            ("r.due_at >= %(filter_due_from)s", "filter_due_from", self.due_from),
            ("r.due_at < %(filter_due_to)s", "filter_due_to", self.due_to),
            ("r.failed_at <= %(filter_failed_by)s", "filter_failed_by", self.failed_by),
        ):
            if value is not None:
                conditions.append(condition)
                params[key] = value
        if self.error is not None:
            conditions.append(
                "(r.last_error->>'message' ILIKE %(filter_error)s"
                " OR r.last_error->>'type' ILIKE %(filter_error)s)"
            )
            escaped = self.error.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            params["filter_error"] = f"%{escaped}%"
        return " AND ".join(conditions) or "true", params

    def describe(self) -> str:
        """The filter in a line, for a confirmation and an audit event's target."""
        if self.everything:
            return "all"
        # Not the moment of a confirmation's count: the person chose the rest, not that.
        chosen = {key: value for key, value in self.as_json().items() if key != "failedBy"}
        return " ".join(f"{key}={value}" for key, value in chosen.items())


def parse_instant(raw: object) -> datetime | None:
    """An aware ISO 8601 time in UTC, or None when `raw` is not one.

    In UTC: PostgreSQL refuses offsets past ±15:59 that Python accepts. A space stands for the
    `+` that a query string turned into one."""
    value = read_iso(raw, plus_as_space=True)
    try:
        return value.astimezone(UTC) if value is not None and value.tzinfo else None
    except OverflowError:  # out of range in UTC
        return None


def parse_bulk_filter(raw: object, prefix: str = "filter") -> BulkFilter:
    """Validate a bulk action's filter; raise FilterError naming every bad field."""
    if not isinstance(raw, dict):
        raise FilterError({prefix: ["Expected an object of job, queue, since, or all: true."]})
    if not raw:
        raise FilterError(
            {prefix: ['An empty filter selects nothing; to act on every run say {"all": true}.']}
        )
    errors: dict[str, list[str]] = {}
    for key in sorted(set(raw) - set(FIELDS)):
        errors[f"{prefix}.{key}"] = ["Unknown filter."]
    if "all" in raw:
        if raw["all"] is not True:
            errors[f"{prefix}.all"] = ["Only true: leave it out to filter by the other fields."]
        elif len(raw) > 1:
            errors[f"{prefix}.all"] = ["Give all: true alone, or the fields to filter by."]
    for key, check in (("job", limits.job_name_problem), ("queue", limits.queue_name_problem)):
        if key in raw:
            problem = check(raw[key])
            if problem is not None:
                errors[f"{prefix}.{key}"] = [problem]
    since = None
    if "since" in raw:
        since = parse_instant(raw["since"])
        if since is None:
            errors[f"{prefix}.since"] = [ISO_RULE]
    if errors:
        raise FilterError(errors)
    return BulkFilter(
        job=raw.get("job"), queue=raw.get("queue"), since=since, everything="all" in raw
    )


def apply(queryset: QuerySet, flt: BulkFilter) -> QuerySet:
    """The runs of `queryset` that `flt` selects (it has already been validated)."""
    if flt.job is not None:
        queryset = queryset.filter(definition__name=flt.job)
    if flt.queue is not None:
        queryset = queryset.filter(queue=flt.queue)
    if flt.since is not None:
        queryset = queryset.filter(created_at__gte=flt.since)
    if flt.due_from is not None:
        queryset = queryset.filter(due_at__gte=flt.due_from)
    if flt.due_to is not None:
        queryset = queryset.filter(due_at__lt=flt.due_to)
    if flt.error is not None:
        queryset = queryset.filter(
            Q(last_error__message__icontains=flt.error) | Q(last_error__type__icontains=flt.error)
        )
    if flt.fingerprint is not None:
        queryset = queryset.filter(error_fingerprint=flt.fingerprint)
    if flt.failed_by is not None:
        queryset = queryset.filter(failed_at__lte=flt.failed_by)
    return queryset


# How many runs of these teams, in these states, a filter selects on the current shard
# database: what a confirmation shows before anything changes. Served by run_team_state
# (team_id, state, -id), or for a group by run_failed_by_fingerprint (team_id,
# error_fingerprint, state, id).
COUNT = """
SELECT count(*) FROM runs_run r
WHERE r.team_id = ANY(%(teams)s::bigint[]) AND r.state = ANY(%(states)s::text[]) AND {where}
"""


def count(team_ids: Sequence[int], states: Sequence[str], flt: BulkFilter) -> int:
    """The runs of `team_ids` in `states` that `flt` selects, on every shard database (one
    that is down raises `shards.Unavailable`: a count without it would be wrong)."""
    if not team_ids or not states:
        return 0
    where, params = flt.where()

    def here() -> int:
        with shards.cursor() as cursor:
            cursor.execute(
                COUNT.format(where=where),
                {"teams": list(team_ids), "states": list(states), **params},
            )
            return cursor.fetchone()[0]

    counts, _ = shards.gather(here, strict=True)
    return sum(counts)
