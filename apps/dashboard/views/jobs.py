"""Job definitions: list, detail, the create/edit form with its live schedule preview, pause and
resume, trigger now, dry-run, delete. Every change goes through apps.jobs.services."""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, time, timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_not_required
from django.core.exceptions import PermissionDenied
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.text import capfirst
from django.views.decorators.http import require_POST

from apps.api.shapes.jobs import parse_definition
from apps.dashboard import queries
from apps.dashboard.forms import (
    SCHEDULE_FIELDS,
    TIME_ZONES,
    BackfillForm,
    DefinitionForm,
    schedule_errors,
    schedule_from,
)
from apps.dashboard.http import (
    HtmxHttpRequest,
    actor,
    already,
    done,
    plural,
    record_refused,
    render_page,
    signed_in,
)
from apps.jobs import backfill, diagnosis, enqueue, services
from apps.jobs import schedule as sched
from apps.jobs.firetimes import load_zone
from apps.jobs.models import JobDefinition, database_of
from apps.jobs.sync import InvalidEntry
from apps.runs import limits, shards
from apps.runs.clock import database_now
from apps.runs.models import Trigger
from apps.teams import access
from apps.teams.models import Role
from scheduler_site.database import failure_words, log_failure

logger = logging.getLogger(__name__)

PREVIEW_COUNT = 10
# The backfill preview lists the first few cron times of the range.
BACKFILL_SAMPLE = 10
# BackfillError keys (the API's body fields) → the form's labels.
BACKFILL_FIELDS = {"from": "From", "to": "To", "schedule": "Schedule"}


def _definition(request: HtmxHttpRequest, name: str) -> JobDefinition:
    if limits.job_name_problem(name) is not None:
        # No job has such a name (and PostgreSQL text cannot hold the NUL some carry).
        raise Http404("No such job.")
    # From its shard's database (a 503 page while that is down).
    with shards.reaching(database_of(name)):
        found = shards.with_teams(
            JobDefinition.objects.named(name).filter(
                team_id__in=access.visible_team_ids(request.user)
            )
        )
    definition = found[0] if found else None
    if definition is None:
        with shards.reaching(database_of(name)):
            theirs = shards.with_teams(JobDefinition.objects.named(name))
        if theirs:  # another team's: recorded, and answered as a missing one
            record_refused(request, theirs[0].team, "job", name)
        raise Http404("No such job.")
    return definition


@signed_in
def jobs(request: HtmxHttpRequest) -> HttpResponse:
    now = database_now()
    teams = list(access.visible_teams(request.user))
    chosen = request.GET.get("team", "")
    team_ids = [t.pk for t in teams if not chosen or t.slug == chosen]
    search = request.GET.get("q", "").strip()[:200]
    after = request.GET.get("after", "")[:200]
    if "\x00" in search + after:
        # PostgreSQL text cannot hold NUL, and no job name has one: nothing matches.
        page, next_after = [], None
    else:
        page, next_after = queries.definitions_page(team_ids, search=search, after=after)
    context = {
        "now": now,
        "teams": teams,
        "chosen_team": chosen,
        "search": search,
        "after": after,
        "definitions": page,
        "next_after": next_after,
        "can_create": bool(access.teams_with_role(request.user, Role.EDITOR)),
        "live": True,
    }
    return render_page(request, "dashboard/jobs.html", context, regions=("page", "results"))


def _preview(definition: JobDefinition, after) -> tuple[list[dict], str, bool]:
    """(next fire times, the schedule's problem or "", whether it is a cron schedule)."""
    try:
        parsed = sched.parse_schedule(definition.schedule)
    except sched.ScheduleError as exc:
        return [], str(exc), False
    return (
        sched.saved_preview(definition, parsed, after, PREVIEW_COUNT),
        "",
        isinstance(parsed, sched.CronSchedule),
    )


@signed_in
def job_detail(request: HtmxHttpRequest, name: str) -> HttpResponse:
    now = database_now()
    definition = _definition(request, name)
    times, problem, is_cron = _preview(definition, now)
    context = {
        "now": now,
        "job": definition,
        "snapshot": services.snapshot(definition),
        "times": times,
        "schedule_problem": problem,
        "reasons": diagnosis.why_definition(definition, now),
        # The scheduler creates a cron time's run ahead of it: that run is the next fire.
        "next_run": queries.next_scheduled_run(definition, now),
        "is_cron": is_cron,
        "backfill_form": BackfillForm(),
        "recent": queries.recent_runs(definition, now),
        "history": queries.audit_for_target(definition.team_id, "job", definition.name),
        "live": True,
    }
    return render_page(request, "dashboard/job_detail.html", context)


@signed_in
def job_backfill(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Backfill a cron job over a past range, in two steps like the bulk actions.

    1. GET: the form. POST without `confirm`: the impact from `backfill.plan`, nothing created.
    2. POST with `confirm=yes`: `backfill.run_backfill` creates (deduplicated, capped, audited).
    Both need the operator role, the same as "Trigger now".
    """
    definition = _changeable(request, name, Role.OPERATOR)
    form = BackfillForm(request.POST if request.method == "POST" else None)
    context = {"job": definition, "backfill_form": form, "plan": None, "errors": []}
    if not form.is_bound or not form.is_valid():
        return render_page(request, "dashboard/job_backfill.html", context, regions=("backfill",))
    start, end = form.bounds()
    try:
        if request.POST.get("confirm") == "yes":
            plan, created = backfill.run_backfill(definition, start, end, actor(request))
        else:
            plan, created = backfill.plan(definition, start, end), None
    except (backfill.BackfillError, sched.ScheduleError) as exc:
        context["errors"] = [
            (BACKFILL_FIELDS.get(key, key), why) for key, why in exc.errors.items()
        ]
        return render_page(request, "dashboard/job_backfill.html", context, regions=("backfill",))
    if created is None:
        sample = plan.times[:BACKFILL_SAMPLE]
        context |= {
            "plan": plan,
            "sample": sample,
            "more": len(plan.times) - len(sample),
            "start": start,
            "end": plan.until,
            "cut_at_now": plan.until < end and not plan.capped,
        }
        return render_page(request, "dashboard/job_backfill.html", context, regions=("backfill",))
    message = f"Backfilled {name}: created {plural(created, 'run')}"
    skipped = len(plan.times) - created
    if skipped:
        message += f"; {plural(skipped, 'cron time')} already had a run"
    if plan.capped:
        message += f"; the range holds more cron times than the cap of {len(plan.times)}"
    return done(request, reverse("dashboard:job", args=[name]), message + ".")


def _form_page(request: HtmxHttpRequest, form: DefinitionForm, definition=None) -> HttpResponse:
    now = database_now()
    times: list[dict] = []
    errors: dict[str, str] = {}
    if form.is_bound or definition is not None:
        times, errors = _schedule_preview(form.data if form.is_bound else form.initial, now)
    context = {
        "now": now,
        "form": form,
        "job": definition,
        "time_zones": TIME_ZONES,
        "times": times,
        "schedule_errors": errors,
        "schedule_field_names": ("kind", *SCHEDULE_FIELDS),
        "preview_from": form.data.get("preview_from", "") if form.is_bound else "",
    }
    return render_page(request, "dashboard/job_form.html", context)


def _schedule_preview(data, now) -> tuple[list[dict], dict[str, str]]:
    schedule = schedule_from(data)
    errors = schedule_errors(schedule)
    if errors:
        return [], errors
    start = _preview_start(data.get("preview_from") or "", schedule, now)
    if isinstance(start, str):
        return [], {"preview_from": start}
    name = data.get("name") or "preview"
    return sched.preview(name, sched.parse_schedule(schedule), start, PREVIEW_COUNT), {}


def _preview_start(raw: str, schedule: dict, now: datetime) -> datetime | str:
    """Where the form's preview starts: now, or midnight of the chosen day in the schedule's
    zone (the fire times from that day on), or why the day cannot be read."""
    if not raw:
        return now
    try:
        day = date.fromisoformat(raw)
    except ValueError:
        return "A day as YYYY-MM-DD."
    if not 2 <= day.year <= 9998:
        return "A day between the years 2 and 9998."
    # A cron schedule's zone was checked with it; the other kinds count from UTC's midnight.
    zone = load_zone(schedule["timeZone"]) if "timeZone" in schedule else UTC
    # Just before midnight: a fire time at 00:00 of that day is the first shown.
    return datetime.combine(day, time(0), zone) - timedelta(microseconds=1)


@signed_in
def job_new(request: HtmxHttpRequest) -> HttpResponse:
    teams = access.teams_with_role(request.user, Role.EDITOR)
    if not teams:
        raise PermissionDenied("Creating a job needs the editor role in a team.")
    if request.method != "POST":
        return _form_page(request, DefinitionForm(teams=teams))
    form = DefinitionForm(request.POST, teams=teams)
    if not form.is_valid():
        return _form_page(request, form)
    team = next(t for t in teams if t.slug == form.cleaned_data["team"])
    access.require_role(request.user, team, Role.EDITOR)
    try:
        with shards.reaching(database_of(form.spec.name)):
            exists = JobDefinition.objects.named(form.spec.name).exists()
        if exists:
            form.add_error("name", "A job with this name exists.")
            return _form_page(request, form)
        definition = services.create_definition(team, form.spec, actor(request))
    except services.NameTaken as exc:
        form.add_error(
            "name",
            "A job with this name is still being deleted; create it again once it is gone."
            if exc.deleting
            else "A job with this name was just created.",
        )
        return _form_page(request, form)
    except shards.Unavailable as exc:
        # The name's shard lives on a database that is down: the form stays, with what was
        # typed, rather than the page of a job that cannot be shown.
        form.add_error(None, f"Not saved: {exc}. Try again once it is back.")
        return _form_page(request, form)
    except (OperationalError, InterfaceError) as exc:
        _not_saved(form, exc)
        return _form_page(request, form)
    return done(
        request, reverse("dashboard:job", args=[definition.name]), f"Created {definition.name}."
    )


@signed_in
def job_edit(request: HtmxHttpRequest, name: str) -> HttpResponse:
    definition = _definition(request, name)
    access.require_role(request.user, definition.team_id, Role.EDITOR)
    teams = [definition.team]
    if request.method != "POST":
        return _form_page(request, DefinitionForm(teams=teams, instance=definition), definition)
    form = DefinitionForm(request.POST, teams=teams, instance=definition)
    if not form.is_valid():
        return _form_page(request, form, definition)
    seen = form.cleaned_data.get("seen")
    try:
        services.update_definition(
            definition, form.spec, actor(request), versions=[seen] if seen else None
        )
    except services.ChangedMeanwhile:
        definition = _definition(request, name)
        form = DefinitionForm.after_conflict(
            request.POST, teams=teams, instance=definition, seen=seen or ""
        )
        return _form_page(request, form, definition)
    except shards.Unavailable as exc:
        form.add_error(None, f"Not saved: {exc}. Try again once it is back.")
        return _form_page(request, form, definition)
    except (OperationalError, InterfaceError) as exc:
        _not_saved(form, exc)
        return _form_page(request, form, definition)
    return done(request, reverse("dashboard:job", args=[name]), f"Saved {name}.")


def _not_saved(form: DefinitionForm, exc: Exception) -> None:
    """A lock held past SCHEDULER_DB_LOCK_TIMEOUT, a dropped connection: the save was rolled
    back, and the form stays, with what was typed and why."""
    log_failure(exc, logger)
    form.add_error(None, f"{capfirst(failure_words(exc))}. Try again.")


@signed_in
def job_preview(request: HtmxHttpRequest) -> HttpResponse:
    """The form's live preview: schedule errors beside their fields, or the next fire times."""
    now = database_now()
    times, errors = _schedule_preview(request.GET, now)
    context = {
        "now": now,
        "times": times,
        "schedule_errors": errors,
        "schedule_field_names": ("kind", "preview_from", *SCHEDULE_FIELDS),
        "oob": True,
    }
    return render_page(request, "dashboard/job_form.html#preview", context)


# The fields the form checks as they are typed, beside the schedule's (the preview's).
CHECKED_FIELDS = tuple(
    name for name in DefinitionForm.base_fields if name not in {*SCHEDULE_FIELDS, "kind", "seen"}
)


@login_not_required
@require_POST
def job_check(request: HtmxHttpRequest) -> HttpResponse:
    """The form's live validation of the fields outside its schedule (the preview judges
    those): each field's reason beside it as saving would give it, before saving (a payload
    that is not JSON was said only once saved). `editing` names the job an edit form is of.

    Signed out (the session ended while typing), nothing is checked and the page stays: sent
    to the sign-in page by a check, the reader lost what was typed; Save keeps it."""
    if not request.user.is_authenticated:
        return HttpResponse(status=204)
    editing = request.POST.get("editing")
    if editing:
        definition = _changeable(request, editing, Role.EDITOR)
        form = DefinitionForm(request.POST, teams=[definition.team], instance=definition)
    else:
        teams = access.teams_with_role(request.user, Role.EDITOR)
        if not teams:
            raise PermissionDenied("Creating a job needs the editor role in a team.")
        form = DefinitionForm(request.POST, teams=teams)
    form.is_valid()
    checked = {name: " ".join(form.errors.get(name, [])) for name in CHECKED_FIELDS}
    return render_page(request, "dashboard/job_form.html#checked", {"checked": checked})


def _changeable(request: HtmxHttpRequest, name: str, role: str) -> JobDefinition:
    definition = _definition(request, name)
    access.require_role(request.user, definition.team_id, role)
    return definition


@require_POST
@signed_in
def job_pause(request: HtmxHttpRequest, name: str, paused: bool) -> HttpResponse:
    definition = _changeable(request, name, Role.OPERATOR)
    _, changed = services.set_paused(definition, paused, actor(request))
    back = reverse("dashboard:job", args=[name])
    if not changed:  # a page left open while someone else paused or resumed it
        event = queries.paused_by(definition.team_id, "job", name, paused)
        state = "paused" if paused else "running"
        return done(request, back, already(name, state, event), messages.INFO)
    verb = "Paused" if paused else "Resumed"
    return done(request, back, f"{verb} {name}.")


@require_POST
@signed_in
def job_trigger(request: HtmxHttpRequest, name: str) -> HttpResponse:
    definition = _changeable(request, name, Role.OPERATOR)
    created = enqueue.create_run(
        definition, actor(request), idempotency_key=None, trigger=Trigger.MANUAL
    )
    return done(
        request,
        reverse("dashboard:run", args=[created.run.run_id]),
        f"Triggered {name}: {created.run.run_id}.",
    )


@require_POST
@signed_in
def job_dry_run(request: HtmxHttpRequest, name: str) -> HttpResponse:
    definition = _changeable(request, name, Role.EDITOR)
    body = {**services.snapshot_to_edit(definition), "dryRun": not definition.dry_run}
    try:
        spec = parse_definition(body)
    except InvalidEntry:
        return done(
            request,
            reverse("dashboard:job", args=[name]),
            "The stored definition no longer validates; edit it first.",
            messages.ERROR,
        )
    updated = services.update_definition(definition, spec, actor(request))
    state = "on" if updated.dry_run else "off"
    return done(request, reverse("dashboard:job", args=[name]), f"Dry run {state} for {name}.")


@signed_in
def job_delete(request: HtmxHttpRequest, name: str) -> HttpResponse:
    definition = _changeable(request, name, Role.EDITOR)
    if request.method != "POST":
        return render_page(request, "dashboard/job_delete.html", {"job": definition})
    if request.POST.get("confirm_name") != definition.name:
        messages.error(request, "Type the job's name to delete it.")
        return redirect("dashboard:job-delete", name=name)
    services.delete_definition(definition, actor(request))
    return done(request, reverse("dashboard:jobs"), f"Deleted {name}.")
