"""Forms: list filters, the definition form (validated by the API's own definition model), team admin."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django import forms
from django.http import QueryDict
from django.utils import timezone
from pydantic import ValidationError as PydanticError
from rest_framework.exceptions import ParseError
from rest_framework.exceptions import ValidationError as DRFValidationError

from apps.api.errors import PayloadTooLarge
from apps.api.parsers import parse_json
from apps.api.shapes import field_errors
from apps.api.shapes.channels import ChannelSettings
from apps.api.shapes.jobs import parse_definition
from apps.audit.models import Source
from apps.jobs import schedule as sched
from apps.jobs import services
from apps.jobs.firetimes import iana_zones
from apps.jobs.models import JobDefinition
from apps.jobs.services import DefinitionSpec
from apps.jobs.sync import InvalidEntry
from apps.notify import channels as notify_channels
from apps.runs import fingerprints, limits
from apps.runs.filters import BulkFilter
from apps.runs.ids import parse_run_id
from apps.runs.models import PRIORITIES
from apps.teams.models import Role, Scope

RANGES = {
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
    "30d": timedelta(days=30),
}
RANGE_CHOICES = [("", "any time"), *((key, f"last {key}") for key in RANGES)]


def _utc_input(value: datetime | None) -> datetime | None:
    """A datetime-local input carries no zone: read in the form's (RunFilterForm.tz)."""
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _zone(name: str) -> ZoneInfo | None:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):  # unknown, or not a key ("../x", a NUL)
        return None


def _named(value: str, problem_of: Callable[[str], str | None]) -> str:
    problem = problem_of(value) if value else None
    if problem is not None:
        raise forms.ValidationError(problem)
    return value


class RunFilterForm(forms.Form):
    team = forms.ChoiceField(required=False)
    queue = forms.CharField(required=False, max_length=100)
    job = forms.CharField(required=False, max_length=200)
    state = forms.ChoiceField(required=False)
    range = forms.ChoiceField(required=False, choices=RANGE_CHOICES)
    due_from = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"})
    )
    due_to = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"})
    )
    error = forms.CharField(required=False, max_length=200)
    # An error group (apps/runs/fingerprints.py), as 16 hex digits.
    group = forms.CharField(required=False, max_length=16)
    # "groups": the failures grouped by error instead of one row per run.
    view = forms.ChoiceField(required=False, choices=[("", "runs"), ("groups", "groups")])
    cursor = forms.CharField(required=False, max_length=40, widget=forms.HiddenInput)
    # The zone the "Due from/before" inputs are typed in: the reader's, set by the page's script
    # (the page shows times in it), kept in the URL so a shared link means the same instants.
    # Empty (no script): UTC.
    tz = forms.CharField(required=False, max_length=64, widget=forms.HiddenInput)

    def __init__(self, data: Any, *, teams: list[Any], states: list[str]) -> None:
        super().__init__(data)
        self.fields["team"].choices = [("", "all teams")] + [(t.slug, t.slug) for t in teams]
        self.fields["state"].choices = [("", "any state")] + [(s, s) for s in states]

    def full_clean(self) -> None:
        # Django reads a datetime typed without a zone in the current one, and refuses a time
        # that does not exist there (skipped by DST) or is ambiguous (repeated), with a reason.
        raw = (self.data.get("tz") or "") if self.is_bound else ""
        zone = (_zone(raw) if len(raw) <= 64 else None) if raw else UTC
        with timezone.override(zone or UTC):
            super().full_clean()
        if zone is None:
            self.add_error("tz", f"Not a time zone: {raw[:64]!r}.")
        for name in ("due_from", "due_to"):
            value = getattr(self, "cleaned_data", {}).get(name)
            try:
                _utc_input(value)
            except OverflowError:  # year 1 east of UTC, year 9999 west of it
                self.add_error(name, "Outside the years 1 to 9999 once read in UTC.")

    def clean_cursor(self) -> int | None:
        raw = self.cleaned_data.get("cursor") or ""
        if not raw:
            return None
        pk = parse_run_id(raw)
        if pk is None:  # as the API says it: not the first page shown as if it were the next
            raise forms.ValidationError("Not a cursor from a previous page.")
        return pk

    # Names follow the rules of the names they filter by (as the API's filters do): one no job
    # or queue can have is an error, not an empty list.
    def clean_queue(self) -> str:
        return _named(self.cleaned_data.get("queue") or "", limits.queue_name_problem)

    def clean_job(self) -> str:
        return _named(self.cleaned_data.get("job") or "", limits.job_name_problem)

    def clean_group(self) -> int | None:
        raw = self.cleaned_data.get("group") or ""
        if not raw:
            return None
        found = fingerprints.from_hex(raw.lower())
        if found is None:
            raise forms.ValidationError("Not an error group (16 hex digits).")
        return found

    def bulk_filter(self, now: datetime) -> BulkFilter:
        """The filter as a bulk action by filter says it (apps/runs/filters.py): what the list
        shows, and what its count and its one statement per shard database select."""
        data = self.cleaned_data
        due_from, due_to = self.window(now)
        flt = BulkFilter(
            job=data.get("job") or None,
            queue=data.get("queue") or None,
            due_from=due_from,
            due_to=due_to,
            error=data.get("error") or None,
            fingerprint=data.get("group"),
        )
        return flt if flt.as_json() else BulkFilter(everything=True)

    def window(self, now: datetime) -> tuple[datetime | None, datetime | None]:
        data = self.cleaned_data
        start = _utc_input(data.get("due_from"))
        if data.get("range"):
            start = now - RANGES[data["range"]]
        return start, _utc_input(data.get("due_to"))


class AuditFilterForm(forms.Form):
    team = forms.ChoiceField(required=False)
    actor = forms.CharField(required=False, max_length=200)
    action = forms.ChoiceField(required=False)
    target = forms.CharField(required=False, max_length=300)
    source = forms.ChoiceField(required=False, choices=[("", "any source")] + list(Source.choices))
    range = forms.ChoiceField(required=False, choices=RANGE_CHOICES)
    cursor = forms.IntegerField(required=False, widget=forms.HiddenInput)

    ACTIONS = [
        "job.create", "job.update", "job.delete", "job.pause", "job.resume", "job.trigger",
        "queue.pause", "queue.resume", "queue.update", "run.create", "run.cancel",
        "run.cancel_request", "run.retry", "job.backfill", "job.overlap_cancel", "dlq.requeue",
        "dlq.discard", "token.create", "token.revoke", "member.set", "member.remove",
        "team.create", "channel.create", "channel.update", "channel.delete", "channel.test",
        # What was refused: another team's objects, failed and locked-out sign-ins.
        "access.denied", "auth.login_failed", "auth.locked_out",
    ]  # fmt: skip

    def __init__(self, data: Any, *, teams: list[Any]) -> None:
        super().__init__(data)
        self.fields["team"].choices = [("", "all teams")] + [(t.slug, t.slug) for t in teams]
        self.fields["action"].choices = [("", "any action")] + [(a, a) for a in self.ACTIONS]


class BackfillForm(forms.Form):
    """The range of a backfill: two UTC times, as `datetime-local` inputs (no zone of their own).
    Whether the range makes sense is `apps.jobs.backfill.plan`'s to say."""

    start = forms.DateTimeField(
        label="From (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
    )
    end = forms.DateTimeField(
        label="To (UTC, inclusive)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
    )

    def bounds(self) -> tuple[datetime, datetime]:
        return _utc_input(self.cleaned_data["start"]), _utc_input(self.cleaned_data["end"])


# --- definitions ----------------------------------------------------------------------------

SCHEDULE_KINDS = [
    ("cron", "cron"),
    ("once", "once, at a time"),
    ("delay", "once, after a delay"),
    ("none", "none (trigger only)"),
]
TIME_ZONES = sorted(iana_zones())  # the names the API takes

# Error paths of the API's definition → the form field that shows them.
FIELD_FOR_PATH = {
    "name": "name",
    "schedule": "kind",
    "schedule.cron": "cron",
    "schedule.timeZone": "time_zone",
    "schedule.jitterSeconds": "jitter_seconds",
    "schedule.missedRunPolicy": "missed_run_policy",
    "schedule.overlapPolicy": "overlap_policy",
    "schedule.startAt": "start_at",
    "schedule.endAt": "end_at",
    "schedule.runAt": "run_at",
    "schedule.delaySeconds": "delay_seconds",
    "queue": "queue",
    "priority": "priority",
    "timeoutSeconds": "timeout_seconds",
    "retry": "retry_max_attempts",
    "retry.maxAttempts": "retry_max_attempts",
    "retry.baseSeconds": "retry_base_seconds",
    "retry.maxSeconds": "retry_max_seconds",
    "concurrency": "concurrency",
    "concurrencyPerKey": "concurrency_per_key",
    "concurrencyKeyField": "concurrency_key_field",
    "rateLimit": "rate_limit_count",
    "rateLimit.count": "rate_limit_count",
    "rateLimit.periodSeconds": "rate_limit_period_seconds",
    "payload": "payload",
    "latenessSloSeconds": "lateness_slo_seconds",
    "owner": "owner",
    "runbookUrl": "runbook_url",
}
SCHEDULE_FIELDS = (
    "cron",
    "time_zone",
    "jitter_seconds",
    "missed_run_policy",
    "overlap_policy",
    "start_at",
    "end_at",
    "run_at",
    "delay_seconds",
)


def schedule_from(data: Any) -> dict[str, Any]:
    """The schedule JSON the form's fields describe (unvalidated; parse_schedule judges it)."""
    kind = data.get("kind") or "cron"
    if kind == "cron":
        schedule: dict[str, Any] = {
            "cron": (data.get("cron") or "").strip(),
            "timeZone": (data.get("time_zone") or "").strip() or sched.DEFAULT_TIME_ZONE,
            "missedRunPolicy": data.get("missed_run_policy") or sched.DEFAULT_MISSED_RUN_POLICY,
            "overlapPolicy": data.get("overlap_policy") or sched.DEFAULT_OVERLAP_POLICY,
        }
        jitter = _int_or_text(data.get("jitter_seconds"))
        schedule["jitterSeconds"] = sched.DEFAULT_JITTER_SECONDS if jitter == "" else jitter
        # A blank bound is no bound.
        for key, field in (("startAt", "start_at"), ("endAt", "end_at")):
            bound = (data.get(field) or "").strip()
            if bound:
                schedule[key] = bound
        return schedule
    if kind == "once":
        return {"runAt": (data.get("run_at") or "").strip()}
    if kind == "delay":
        return {"delaySeconds": _int_or_text(data.get("delay_seconds"))}
    return {}


def _int_or_text(value: Any) -> Any:
    if isinstance(value, int):
        return value
    text = (value or "").strip() if isinstance(value, str) else ""
    try:
        return int(text)
    except ValueError:
        return text


def schedule_errors(schedule: dict[str, Any]) -> dict[str, str]:
    """{form field: reason} for a schedule, from the one module that owns schedule rules."""
    try:
        sched.parse_schedule(schedule)
    except sched.ScheduleError as exc:
        return {FIELD_FOR_PATH.get(path, "kind"): reason for path, reason in exc.errors.items()}
    return {}


class DefinitionForm(forms.Form):
    """The edit form. Its fields are the API's definition JSON spread out for people; `clean`
    hands that JSON to the API's definition model, so both validate by the same rules."""

    team = forms.ChoiceField()
    name = forms.CharField(
        max_length=200, help_text="Lowercase dotted words, e.g. billing.export-invoices"
    )
    kind = forms.ChoiceField(choices=SCHEDULE_KINDS, initial="cron", label="Schedule")
    cron = forms.CharField(
        required=False,
        max_length=200,
        help_text="minute hour day-of-month month day-of-week, or @daily",
        widget=forms.TextInput(
            attrs={"class": "mono", "autocomplete": "off", "spellcheck": "false"}
        ),
    )
    time_zone = forms.CharField(
        required=False,
        max_length=64,
        initial="UTC",
        label="Time zone",
        help_text="IANA name, e.g. Europe/Berlin",
        widget=forms.TextInput(attrs={"list": "time-zones", "autocomplete": "off"}),
    )
    jitter_seconds = forms.CharField(required=False, initial="60", label="Jitter (s)")
    missed_run_policy = forms.ChoiceField(
        choices=[(p, p) for p in sched.MISSED_RUN_POLICIES], initial="run_once", label="Missed runs"
    )
    # Not a ChoiceField: a value it does not list gets the schedule's own reason (parse_schedule)
    # beside it, as every other schedule field does.
    overlap_policy = forms.CharField(
        required=False,
        initial=sched.DEFAULT_OVERLAP_POLICY,
        label="Overlap",
        help_text="When a fire time comes while a run is waiting or running",
        widget=forms.Select(
            choices=[(p, f"{p} — {words}") for p, words in sched.OVERLAP_POLICIES.items()]
        ),
    )
    start_at = forms.CharField(
        required=False,
        max_length=40,
        label="Start at (ISO, with offset)",
        help_text="No run before it; empty: from now",
    )
    end_at = forms.CharField(
        required=False,
        max_length=40,
        label="End at (ISO, with offset)",
        help_text="No run after it (a run at it still runs); empty: no end",
    )
    run_at = forms.CharField(required=False, max_length=40, label="Run at (ISO, with offset)")
    delay_seconds = forms.CharField(required=False, label="Delay (s)")
    queue = forms.CharField(max_length=100, initial="default")
    priority = forms.ChoiceField(choices=[(p, p) for p in PRIORITIES], initial="default")
    timeout_seconds = forms.IntegerField(initial=3600, label="Timeout (s)")
    retry_max_attempts = forms.IntegerField(initial=3, label="Max attempts")
    retry_base_seconds = forms.IntegerField(initial=30, label="Backoff base (s)")
    retry_max_seconds = forms.IntegerField(initial=1800, label="Backoff max (s)")
    concurrency = forms.IntegerField(
        required=False,
        label="Concurrency",
        help_text="Most leased runs at once; empty is unlimited",
    )
    concurrency_per_key = forms.IntegerField(
        required=False,
        label="Per key",
        help_text="Most leased runs per concurrency key; empty is unlimited",
    )
    concurrency_key_field = forms.CharField(
        required=False,
        max_length=100,
        label="Key field",
        help_text="The payload field that keys a cron run",
    )
    rate_limit_count = forms.IntegerField(
        required=False,
        label="Rate limit (starts)",
        help_text="Most leases started per window; empty is unlimited",
    )
    rate_limit_period_seconds = forms.IntegerField(
        required=False, label="Rate window (s)", help_text="The sliding window of the rate limit"
    )
    payload = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 6, "spellcheck": "false"}),
        initial="{}",
        required=False,
    )
    paused = forms.BooleanField(required=False)
    dry_run = forms.BooleanField(required=False, label="Dry run")
    owner = forms.CharField(required=False, max_length=200, help_text="Who is called when it fails")
    runbook_url = forms.CharField(required=False, max_length=500, label="Runbook URL")
    lateness_slo_seconds = forms.IntegerField(
        required=False,
        label="Lateness SLO (s)",
        help_text="Flag starts later than this; empty: not watched",
    )
    # The version of the job the form was opened on (services.version_of): a save over a change
    # made since (a pause during an incident) is refused, not written back over it.
    seen = forms.CharField(required=False, widget=forms.HiddenInput, max_length=64)

    def __init__(
        self, data: Any = None, *, teams: list[Any], instance: JobDefinition | None = None
    ):
        initial = self.initial_for(instance) if instance is not None else None
        super().__init__(data, initial=initial)
        self.instance = instance
        self.fields["team"].choices = [(t.slug, t.slug) for t in teams]
        if instance is not None:
            # A definition keeps its name and team: both decide its shard and its runs' keys.
            self.fields["name"].disabled = True
            self.fields["team"].disabled = True
            self.fields["team"].choices = [(instance.team.slug, instance.team.slug)]
        self.spec: DefinitionSpec | None = None
        # A field's note after a save refused over a change made meanwhile (`after_conflict`).
        self.notes: dict[str, str] = {}

    @classmethod
    def initial_for(cls, definition: JobDefinition) -> dict[str, Any]:
        return cls.initial_of(definition.team.slug, services.snapshot_to_edit(definition))

    @staticmethod
    def initial_of(team: str, snap: dict[str, Any]) -> dict[str, Any]:
        """The form's fields for a definition's fields (`services.snapshot`)."""
        schedule = snap["schedule"] or {}
        kind = (
            "cron" if "cron" in schedule
            else "once" if "runAt" in schedule
            else "delay" if "delaySeconds" in schedule
            else "none"
        )  # fmt: skip
        retry = snap["retry"]
        rate_limit = snap.get("rateLimit") or {}
        return {
            "team": team,
            "name": snap["name"],
            "kind": kind,
            "cron": schedule.get("cron", ""),
            "time_zone": schedule.get("timeZone", "UTC"),
            "jitter_seconds": schedule.get("jitterSeconds", sched.DEFAULT_JITTER_SECONDS),
            "missed_run_policy": schedule.get("missedRunPolicy", sched.DEFAULT_MISSED_RUN_POLICY),
            "overlap_policy": schedule.get("overlapPolicy", sched.DEFAULT_OVERLAP_POLICY),
            "start_at": schedule.get("startAt", ""),
            "end_at": schedule.get("endAt", ""),
            "run_at": schedule.get("runAt", ""),
            "delay_seconds": schedule.get("delaySeconds", ""),
            "queue": snap["queue"],
            "priority": snap["priority"],
            "timeout_seconds": snap["timeoutSeconds"],
            "retry_max_attempts": retry["maxAttempts"],
            "retry_base_seconds": retry["baseSeconds"],
            "retry_max_seconds": retry["maxSeconds"],
            "concurrency": snap["concurrency"],
            "concurrency_per_key": snap.get("concurrencyPerKey"),
            "concurrency_key_field": snap.get("concurrencyKeyField", ""),
            "rate_limit_count": rate_limit.get("count"),
            "rate_limit_period_seconds": rate_limit.get("periodSeconds"),
            "payload": json.dumps(snap["payload"], indent=2, sort_keys=True),
            "paused": snap["paused"],
            "dry_run": snap.get("dryRun", False),
            "owner": snap.get("owner", ""),
            "runbook_url": snap.get("runbookUrl", ""),
            "lateness_slo_seconds": snap.get("latenessSloSeconds"),
            "seen": services.version_of(snap),
        }

    @classmethod
    def after_conflict(
        cls, data: QueryDict, *, teams: list[Any], instance: JobDefinition, seen: str
    ) -> DefinitionForm:
        """The form again after a save refused because the job changed since the form was
        opened at version `seen`: a field the reader left as it was takes the job's value now
        (saving it back undid a pause made meanwhile); a field both changed keeps what was
        typed, with the other value beside it. The form is marked as seen over the job as it is
        now, so saving again is a choice made knowing of the change."""
        now = cls.initial_for(instance)
        opened_fields = services.fields_at(instance, seen) if seen else None
        data = data.copy()
        data["seen"] = now["seen"]
        fields = cls(teams=teams, instance=instance).fields
        theirs: list[str] = []
        both: list[str] = []
        if opened_fields is not None:
            opened = cls.initial_of(instance.team.slug, opened_fields)
            for name, field in fields.items():
                if field.disabled or name == "seen" or opened[name] == now[name]:
                    continue
                typed = field.widget.value_from_datadict(data, None, name)
                if not _differs(field, opened[name], typed):
                    _put(data, name, field, now[name])
                    theirs.append(name)
                elif _differs(field, now[name], typed):
                    both.append(name)
        form = cls(data, teams=teams, instance=instance)
        form.is_valid()
        # Notes, not errors: the form's check as the reader types (apps/dashboard/views/
        # jobs.py, `job_check`) puts each field's errors again, and wiped these.
        for name in both:
            form.notes[name] = (
                f"Changed meanwhile to {_shown(fields[name], now[name])}; "
                "saving again writes what you typed over it."
            )
        if opened_fields is None:
            form.add_error(
                None,
                "Not saved: someone changed this job since this form was opened (its audit "
                "trail says what). Check the fields against the job's page, then save again.",
            )
            return form
        words = ["Not saved: someone changed this job since this form was opened."]
        if theirs:
            words.append(f"Their change to {_labels(fields, theirs)} is now in the form.")
        if both:
            words.append(f"You both changed {_labels(fields, both)}: check beside each.")
        words.append("Save again to keep the form as it is now.")
        form.add_error(None, " ".join(words))
        return form

    def clean_payload(self) -> Any:
        raw = (self.cleaned_data.get("payload") or "").strip() or "{}"
        # The API's reading of a body, so the form refuses what the API does: NaN and
        # Infinity, integers past 64 bits, nesting past the limit, NUL characters (which
        # PostgreSQL cannot store: json.loads took them, and saving answered 500).
        try:
            value = parse_json(raw.encode())
        except ParseError as exc:
            raise forms.ValidationError(f"Not valid JSON: {exc.__cause__}") from exc
        except DRFValidationError as exc:
            detail = exc.detail
            if isinstance(detail, dict):
                detail = next(iter(detail.values()))
            if isinstance(detail, list):
                detail = detail[0]
            raise forms.ValidationError(str(detail)) from exc
        # Inside a definition's JSON the payload is one level down, and the API counts from
        # the body's own level: a payload the form took at the limit could not be sent back
        # through PUT /api/v1/jobs/{name} or a jobs file.
        inside = limits.json_max_depth() - 1
        if limits.json_too_deep(value, inside) is not None:
            raise forms.ValidationError(
                f"Nested deeper than {inside} levels of objects and lists (the definition's "
                "JSON holds it one level down)."
            )
        return value

    def clean(self) -> dict[str, Any]:
        """Hand the fields, as the API's JSON, to the API's definition; put each reason beside
        its field. A field that failed its own parsing is sent as its default, so the other
        fields still get their reasons in the same answer."""
        data = super().clean()
        # Editing starts from the stored definition, so a field this form does not show keeps
        # its value instead of falling back to the default.
        body: dict[str, Any] = (
            services.snapshot_to_edit(self.instance) if self.instance is not None else {}
        )
        body |= {
            "name": data.get("name", "x"),
            "schedule": schedule_from(self.data),
            "queue": data.get("queue", "default"),
            "priority": data.get("priority", "default"),
            "timeoutSeconds": data.get("timeout_seconds", 3600),
            "retry": {
                "maxAttempts": data.get("retry_max_attempts", 3),
                "baseSeconds": data.get("retry_base_seconds", 30),
                "maxSeconds": data.get("retry_max_seconds", 1800),
            },
            "concurrency": data.get("concurrency"),
            "concurrencyPerKey": data.get("concurrency_per_key"),
            "concurrencyKeyField": data.get("concurrency_key_field") or "",
            "rateLimit": _rate_limit(data),
            "payload": data.get("payload", {}),
            "paused": data.get("paused", False),
            "dryRun": data.get("dry_run", False),
            "owner": data.get("owner", ""),
            "runbookUrl": data.get("runbook_url", ""),
            "latenessSloSeconds": data.get("lateness_slo_seconds"),
        }
        try:
            spec = parse_definition(body)
        except PayloadTooLarge as exc:
            self.add_error("payload", str(exc.detail))
            return data
        except InvalidEntry as exc:
            for path, reasons in exc.errors.items():
                name = FIELD_FOR_PATH.get(path)
                if name in self.errors:
                    continue
                for reason in reasons:
                    self.add_error(name, reason if name else f"{path}: {reason}")
            return data
        if not self.errors:
            self.spec = spec
        return data


class MemberForm(forms.Form):
    username = forms.CharField(max_length=150)
    role = forms.ChoiceField(choices=Role.choices, initial=Role.VIEWER)


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, required=False)
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices, widget=forms.CheckboxSelectMultiple, initial=[Scope.WORKER]
    )


def _rate_limit(data: dict[str, Any]) -> dict[str, Any] | None:
    """The API's `rateLimit` from the two inputs: none when both are empty; one alone is sent
    as it is, and the API's reason lands beside the missing one."""
    count, period = data.get("rate_limit_count"), data.get("rate_limit_period_seconds")
    if count is None and period is None:
        return None
    return {
        key: value
        for key, value in (("count", count), ("periodSeconds", period))
        if value is not None  # a 0 is sent, for the API's reason, not dropped as missing
    }


# --- notification channels --------------------------------------------------------------------

CHANNEL_KINDS = [
    ("webhook", "Webhook (signed JSON)"),
    ("slack", "Slack incoming webhook"),
    ("email", "Email"),
]
CHANNEL_EVENTS = [
    ("run.dead", "run.dead — a run reached the DLQ"),
    ("job.late", "job.late — a run started, or has not started, later than its SLO"),
    ("job.missed", "job.missed — a cron time had no successful run"),
    ("dlq.threshold", "dlq.threshold — the DLQ is over its threshold"),
    ("scheduler.shard_unowned", "scheduler.shard_unowned — shards without a scheduler"),
    ("job.recovered", "job.recovered — a paged job recovered"),
]


def _names(raw: str) -> list[str]:
    return [part for part in raw.replace(",", " ").split() if part]


class ChannelForm(forms.Form):
    """A notification channel of `team`, validated by the API's own channel model and by the
    domain's check (apps/notify/channels.py), each reason beside its field."""

    name = forms.CharField(max_length=100, help_text="e.g. on-call pager")
    kind = forms.ChoiceField(choices=CHANNEL_KINDS, initial="webhook")
    target = forms.CharField(
        max_length=2000,
        help_text="An https:// URL, or an email address",
        widget=forms.TextInput(attrs={"autocomplete": "off", "spellcheck": "false"}),
    )
    events = forms.MultipleChoiceField(
        choices=CHANNEL_EVENTS,
        initial=["run.dead", "job.recovered"],
        widget=forms.CheckboxSelectMultiple,
    )
    jobs = forms.CharField(
        required=False, max_length=20000, help_text="Job names, comma-separated; empty: all"
    )
    queues = forms.CharField(
        required=False, max_length=10000, help_text="Queue names, comma-separated; empty: all"
    )

    FIELDS = ("name", "kind", "target", "events", "jobs", "queues")

    def __init__(self, data: Any = None, *, team: Any) -> None:
        super().__init__(data)
        self.team = team
        self.spec = None

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        body = {
            "name": data.get("name", "x"),
            "kind": data.get("kind", "webhook"),
            "target": data.get("target", "x"),
            "events": data.get("events") or [],
            "jobs": _names(data.get("jobs") or ""),
            "queues": _names(data.get("queues") or ""),
        }
        try:
            self.spec = ChannelSettings.model_validate(body).to_spec()
        except PydanticError as exc:
            self.add_reasons(field_errors(exc))
        # The domain's rules too (the target's address, the team's names and limit), whatever
        # else is wrong, so that one answer says everything; it checks again when it saves.
        self.add_reasons(notify_channels.check(self.team, notify_channels.ChannelSpec(**body)))
        return data

    def add_reasons(self, errors: dict[str, list[str]]) -> None:
        """Put the API's or the domain's reasons (`jobs[2]`, `body`) beside the form's fields."""
        for path, reasons in errors.items():
            field = path.split("[")[0]
            field = field if field in self.FIELDS else None
            if field is not None and field in self.errors:
                continue
            for reason in reasons:
                self.add_error(field, reason if path == field else f"{path}: {reason}")


def _differs(field: forms.Field, initial: Any, typed: Any) -> bool:
    """Whether what was typed says something else than `initial`: a browser sends a text
    area's lines ended by CRLF (a payload shown as several lines read as changed), and a
    payload is the JSON it says, however it is laid out."""
    if isinstance(typed, str):
        typed = typed.replace("\r\n", "\n")
    if isinstance(field.widget, forms.Textarea) and isinstance(initial, str):
        try:
            return json.loads(initial) != json.loads(typed)
        except (TypeError, ValueError, RecursionError):
            pass
    return field.has_changed(initial, typed)


def _put(data: QueryDict, name: str, field: forms.Field, value: Any) -> None:
    """Write a field's value into a form's data as a browser would send it."""
    if isinstance(field, forms.BooleanField):
        if value:
            data[name] = "on"
        elif name in data:
            del data[name]
    else:
        data[name] = "" if value is None else str(value)


def _shown(field: forms.Field, value: Any) -> str:
    if isinstance(field, forms.BooleanField):
        return "on" if value else "off"
    return "empty" if value in (None, "") else f"“{value}”"


def _labels(fields: dict[str, forms.Field], names: list[str]) -> str:
    return ", ".join(
        str(fields[name].label or name.replace("_", " ").capitalize()) for name in names
    )
