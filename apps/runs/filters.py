"""The filter of a bulk action (requeue, discard, retry): what it may say, and what it selects.

A bulk action's filter never widens by accident. Every field is a non-empty value of its type;
`null`, `""`, `false` and `[]` are errors, not "match anything" (a discard with
`{"job": null}` once emptied a team's whole dead-letter queue), and an empty filter is an error
too. Acting on everything is said outright: `{"all": true}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db.models import QuerySet
from django.utils.dateparse import parse_datetime

from apps.runs import limits
from apps.runs.clock import format_utc

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
    since: datetime | None = None
    everything: bool = False

    def as_json(self) -> dict[str, Any]:
        """The filter as the caller gave it (for the audit trail)."""
        if self.everything:
            return {"all": True}
        answer: dict[str, Any] = {}
        if self.job is not None:
            answer["job"] = self.job
        if self.queue is not None:
            answer["queue"] = self.queue
        if self.since is not None:
            answer["since"] = format_utc(self.since)
        return answer


def parse_instant(raw: object) -> datetime | None:
    """An aware ISO 8601 time in UTC, or None when `raw` is not one.

    In UTC: PostgreSQL refuses offsets past ±15:59 that Python accepts. A space stands for the
    `+` that a query string turned into one."""
    if not isinstance(raw, str) or not raw or "\x00" in raw or len(raw) > 64:
        return None
    try:
        value = parse_datetime(raw.replace(" ", "+"))
        return value.astimezone(UTC) if value is not None and value.tzinfo else None
    except (ValueError, OverflowError):  # e.g. 12:99, or out of range in UTC
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
    return queryset
