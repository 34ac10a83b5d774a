"""Failures, runs and the dead-letter queue (one list, three presets; failures and the DLQ also
grouped by error), a run's page, the run-id search, and the run actions — retry, cancel,
requeue, discard — one at a time, on ticked rows, or on everything a filter or an error group
selects, each in bulk after a confirmation that shows the count."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from apps.audit.record import Actor
from apps.dashboard import queries
from apps.dashboard.forms import RunFilterForm
from apps.dashboard.http import (
    HtmxHttpRequest,
    actor,
    done,
    is_live,
    plural,
    record_refused,
    render_page,
    signed_in,
)
from apps.dashboard.templatetags.dashboard import when
from apps.jobs import diagnosis, runlist, triage
from apps.runs import filters, payloads, transitions
from apps.runs.clock import database_now, format_utc
from apps.runs.ids import parse_run_id
from apps.runs.models import WAITING_STATES, Run, State, reported_state
from apps.teams import access
from apps.teams.models import Role


@dataclass(frozen=True)
class RunAction:
    name: str
    verb: str  # "Retry"
    past: str  # "Retried"
    applies_to: frozenset[str]  # stored states the transition accepts
    change: Callable[[Sequence[Run], Actor], list[Run]]
    destructive: bool


ACTIONS = {
    action.name: action
    for action in (
        RunAction("retry", "Retry", "Retried", frozenset({"retrying", "dead"}), transitions.retry, False),
        # A leased run is asked to stop; it ends cancelled when its worker reports.
        RunAction("cancel", "Cancel", "Cancelled", frozenset({"scheduled", "ready", "retrying", "leased"}), transitions.cancel, True),
        RunAction("requeue", "Requeue", "Requeued", frozenset({"dead"}), transitions.requeue, False),
        RunAction("discard", "Discard", "Discarded", frozenset({"dead"}), transitions.discard, True),
    )
}  # fmt: skip


@dataclass(frozen=True)
class ListMode:
    url_name: str
    title: str
    template_states: list[str]  # the state filter's choices
    actions: list[str]
    empty: str
    grouped: bool = False  # may be shown grouped by error, and acted on by filter or group


MODES = {
    "failures": ListMode(
        "dashboard:failures", "Failures", ["retrying", "dead"], ["retry", "cancel"],
        "Nothing is failing. Runs that failed and are waiting to retry, or are dead, show here.",
        grouped=True,
    ),
    "runs": ListMode(
        "dashboard:runs", "Runs", [s.value for s in State], ["retry", "cancel"],
        "No runs match these filters.",
    ),
    "dlq": ListMode(
        "dashboard:dlq", "Dead-letter queue", [], ["requeue", "discard"],
        "The dead-letter queue is empty.", grouped=True,
    ),
}  # fmt: skip

# The list filters a bulk action by filter carries to its confirmation and back.
FILTER_FIELDS = (
    "team", "queue", "job", "state", "range", "due_from", "due_to", "tz", "error", "group",
)  # fmt: skip


def _branches(mode: str, state: str) -> list[runlist.Branch]:
    if mode == "dlq":
        return [(State.DEAD.value, None)]
    if mode == "failures":
        return [(state, None)] if state else list(runlist.FAILED_STORED)
    return list(runlist.REPORTED_TO_STORED.get(state, runlist.ALL_STORED))


def _stored_states(mode_name: str, state: str) -> list[str]:
    """The stored states a list of failures or dead runs shows (its branches, without the clock)."""
    return sorted({stored for stored, _ in _branches(mode_name, state)})


def _run_list(request: HtmxHttpRequest, mode_name: str) -> HttpResponse:
    mode = MODES[mode_name]
    now = database_now()
    teams = list(access.visible_teams(request.user))
    form = RunFilterForm(request.GET, teams=teams, states=mode.template_states)
    page = runlist.RunPage([], None)
    grouping = None
    cursor = None
    shown = teams
    if form.is_valid():
        data = form.cleaned_data
        cursor = data["cursor"]
        shown = [t for t in teams if not data["team"] or t.slug == data["team"]]
        team_ids = [t.pk for t in shown]
        if mode.grouped and data["view"] == "groups":
            states = _stored_states(mode_name, data["state"])
            grouping = triage.groups(team_ids, states, form.bulk_filter(now))
        else:
            due_from, due_to = form.window(now)
            flt = runlist.RunFilter(
                team_ids=team_ids,
                branches=_branches(mode_name, data["state"]),
                queue=data["queue"],
                job=data["job"],
                due_from=due_from,
                due_to=due_to,
                error=data["error"],
                fingerprint=data["group"],
            )
            page = runlist.run_page(flt, now, before=cursor)
    # The teams whose runs the page shows and the user may act on: none, and no buttons, on a
    # page filtered to a team the user only views (its actions would be refused).
    acting = [t.pk for t in shown if access.has_role(request.user, t, Role.OPERATOR)]
    actions = [ACTIONS[name] for name in mode.actions]
    context = {
        "now": now,
        "mode": mode,
        "mode_name": mode_name,
        "form": form,
        "page": page,
        "grouping": grouping,
        "cursor": cursor,
        "search_scan": f"{runlist.SEARCH_SCAN:,}",
        "census_seconds": settings.SCHEDULER_CENSUS_SECONDS,
        "actions": actions,
        "can_act": bool(acting),
        # Each group with the runs of it the user may act on and, per action, those of them
        # it accepts: its buttons count those, as the confirmation does, not the runs of teams
        # the user only views nor those in a state the action leaves alone (a dead run is not
        # cancelled).
        "group_rows": [
            (g, g.count_in(acting), [(a, g.count_in(acting, a.applies_to)) for a in actions])
            for g in grouping.groups
        ]
        if grouping
        else [],
        # The filter as the page was asked for it, for the actions on everything it selects.
        "carry": [(key, request.GET[key]) for key in FILTER_FIELDS if request.GET.get(key)],
        # An empty filtered list says so: "The dead-letter queue is empty." under a filter left
        # an on-call engineer believing it clear while other dead runs waited.
        "filtered": any(request.GET.get(key) for key in FILTER_FIELDS if key != "tz"),
        "live": True,
    }
    return render_page(request, "dashboard/runs.html", context, regions=("page", "results"))


@signed_in
def failures(request: HtmxHttpRequest) -> HttpResponse:
    return _run_list(request, "failures")


@signed_in
def runs(request: HtmxHttpRequest) -> HttpResponse:
    """The runs list; with `?run=<runId>` (the header's search box), that run's page, or the
    list saying there is no such run (another team's run is no more found than a missing one)."""
    wanted = request.GET.get("run", "").strip()
    if wanted and not is_live(request):  # the live updates of such a page are the list's
        visible, pk = access.visible_team_ids(request.user), parse_run_id(wanted)
        run = queries.visible_run(visible, pk)
        if run is not None:
            return redirect("dashboard:run", run.run_id)
        _refused(request, visible, [pk] if pk is not None else [])
        messages.warning(request, f"No such run: {wanted[:60]}", fail_silently=True)
    return _run_list(request, "runs")


@signed_in
def dlq(request: HtmxHttpRequest) -> HttpResponse:
    return _run_list(request, "dlq")


def _visible_run(request: HtmxHttpRequest, run_id: str) -> Run:
    """The run, if the user's teams own it; another team's run is a 404, like a missing one,
    and the attempt is recorded."""
    visible, pk = access.visible_team_ids(request.user), parse_run_id(run_id)
    run = queries.visible_run(visible, pk)
    if run is None:
        _refused(request, visible, [pk] if pk is not None else [])
        raise Http404("No such run.")
    return run


def _refused(request: HtmxHttpRequest, visible: list[int], pks: list[int]) -> None:
    """Record, per team, the runs of other teams among `pks` that the request named."""
    for team, run_ids in queries.runs_elsewhere(visible, pks).items():
        record_refused(request, team, "run", run_ids)


@signed_in
def run_detail(request: HtmxHttpRequest, run_id: str) -> HttpResponse:
    now = database_now()
    run = _visible_run(request, run_id)
    run.shown_state = reported_state(run.state, run.available_at, now)
    attempts = list(run.attempts.order_by("fencing_token"))
    context = {
        "now": now,
        "run": run,
        # The last error is the run's own while it is failing (retrying, dead); a run that went
        # on (succeeded, requeued, cancelled) shows it only as history, in its attempt.
        "failing": run.state in FAILING_STATES and bool(run.last_error),
        # "Why is this not running?" only asks about a run that waits.
        "reasons": diagnosis.why_run(run, now) if run.state in WAITING_STATES else None,
        "late": run.is_late(),
        "attempts": attempts,
        "payload": payloads.shown(run.payload, run.payload_key),
        "history": queries.audit_for_target(run.team_id, "run", run.run_id),
        "actions": _actions_for(run),
        "live": True,
    }
    return render_page(request, "dashboard/run_detail.html", context)


FAILING_STATES = frozenset({"retrying", "dead"})


def _actions_for(run: Run) -> list[RunAction]:
    """The actions a run's page offers: those its state allows, once each. A dead run's retry
    is its requeue, so it is offered as Requeue alone (both buttons did the same)."""
    offered = []
    for action in ACTIONS.values():
        if run.state not in action.applies_to:
            continue
        if action.name == "cancel" and run.cancel_requested:
            continue
        if action.name == "retry" and run.state == State.DEAD:
            continue
        offered.append(action)
    return offered


@require_POST
@signed_in
def run_action(request: HtmxHttpRequest, run_id: str, action: str) -> HttpResponse:
    spec = ACTIONS.get(action)
    if spec is None:
        raise Http404("No such action.")
    run = _visible_run(request, run_id)
    access.require_role(request.user, run.team_id, Role.OPERATOR)
    changed = spec.change([run], actor(request))
    fallback = reverse("dashboard:run", args=[run.run_id])
    if changed and run.state == State.LEASED:
        return done(
            request,
            fallback,
            f"Asked the worker of {run.run_id} to stop: it ends cancelled when the worker"
            " reports or its lease expires.",
        )
    if changed:
        return done(request, fallback, f"{spec.past} {run.run_id}.")
    run.refresh_from_db(fields=["state"])
    return done(
        request,
        fallback,
        f"Could not {spec.name} {run.run_id}: it is {run.state}.",
        messages.WARNING,
    )


@require_POST
@signed_in
def bulk(request: HtmxHttpRequest) -> HttpResponse:
    """Step 1 (no `confirm`): name the count and ask. Step 2: apply the transition."""
    spec = ACTIONS.get(request.POST.get("action", ""))
    if spec is None:
        return done(request, reverse("dashboard:failures"), "Choose an action.", messages.WARNING)
    pks = [pk for pk in map(parse_run_id, request.POST.getlist("ids")) if pk is not None]
    visible = access.visible_team_ids(request.user)
    selected = queries.runs_by_ids(visible, pks[:1000])
    if len(selected) < len(set(pks[:1000])):
        _refused(request, visible, sorted(set(pks[:1000]) - {run.pk for run in selected}))
    fallback = reverse("dashboard:failures")
    if not selected:
        return done(request, fallback, "Select at least one run first.", messages.WARNING)
    access.require_role_in_all(request.user, (run.team_id for run in selected), Role.OPERATOR)
    eligible = [run for run in selected if run.state in spec.applies_to]
    if request.POST.get("confirm") != "yes":
        context = {
            "spec": spec,
            "eligible": eligible,
            "skipped": len(selected) - len(eligible),
            "next": request.POST.get("next", ""),
        }
        return render_page(request, "dashboard/bulk_confirm.html", context, regions=("dialog",))
    unreached: list[str] = []
    try:
        changed = spec.change(eligible, actor(request))
    except transitions.PartlyTransitioned as exc:  # not a 503 page over runs that changed
        changed, unreached = exc.changed, exc.spans
    message = f"{spec.past} {plural(len(changed), 'run')}."
    if unreached:
        message += f" {_not_changed(unreached)}"
    elif skipped := len(selected) - len(changed):
        message += f" {plural(skipped, 'run')} had changed state and {'was' if skipped == 1 else 'were'} left as {'it was' if skipped == 1 else 'they were'}."
    level = messages.SUCCESS if changed and not unreached else messages.WARNING
    return done(request, fallback, message, level)


class Described(NamedTuple):
    """One line of what a confirmation acts on: words, or a time the page shows in the
    reader's zone."""

    label: str
    text: str = ""
    at: datetime | None = None


def _described(flt: filters.BulkFilter, teams: Sequence[Any], states: list[str]) -> list[Described]:
    """What an action on everything matching acts on, for the person confirming it: an error
    group by its error (its key meant nothing to them), times as times (UTC text before)."""
    lines = [Described("teams", ", ".join(t.slug for t in teams))]
    if flt.everything:
        lines.append(Described("runs", "everything"))
    if flt.job is not None:
        lines.append(Described("job", flt.job))
    if flt.queue is not None:
        lines.append(Described("queue", flt.queue))
    for label, at in (
        ("failed since", flt.since), ("due from", flt.due_from), ("due before", flt.due_to)
    ):  # fmt: skip
        if at is not None:
            lines.append(Described(label, at=at))
    if flt.error is not None:
        lines.append(Described("error contains", flt.error))
    if flt.fingerprint is not None:
        grouping = triage.groups([t.pk for t in teams], states, flt, limit=1)
        label = grouping.groups[0].label if grouping.groups else "no run of it matches now"
        lines.append(Described("error group", label))
    return lines


@require_POST
@signed_in
def bulk_matching(request: HtmxHttpRequest) -> HttpResponse:
    """An action on everything a list's filter (or one of its error groups) selects.

    Step 1 (no `confirm`): count what it would change, on every shard database, and ask.
    Step 2: one statement per shard database, audited once per team with the filter
    (`transitions.act_on_matching`). The relative time range of step 1 travels to step 2 as
    the absolute window it meant, and the moment of the count as `failed_by`, so step 2 acts
    on the runs step 1 counted (less any handled meanwhile), not on runs that failed since.
    """
    mode_name = request.POST.get("mode", "")
    mode = MODES.get(mode_name)
    if mode is None or not mode.grouped:
        raise Http404("No such list.")
    fallback = reverse(mode.url_name)
    spec = ACTIONS.get(request.POST.get("action", ""))
    if spec is None or spec.name not in mode.actions:
        return done(request, fallback, "Choose an action.", messages.WARNING)
    now = database_now()
    teams = list(access.visible_teams(request.user))
    form = RunFilterForm(request.POST, teams=teams, states=mode.template_states)
    if not form.is_valid():
        return done(request, fallback, "Fix the filter first.", messages.WARNING)
    data = form.cleaned_data
    if data["team"]:
        chosen = [t for t in teams if t.slug == data["team"]]
        access.require_role_in_all(request.user, (t.pk for t in chosen), Role.OPERATOR)
    else:
        # "All teams" acts on those the user may act on (the confirmation names them).
        chosen = [t for t in teams if access.has_role(request.user, t, Role.OPERATOR)]
        if not chosen:
            raise PermissionDenied("This needs the operator role in a team.")
    states = sorted(
        transitions.MATCHING[spec.name].states & set(_stored_states(mode_name, data["state"]))
    )
    flt = form.bulk_filter(now)
    if request.POST.get("confirm") != "yes":
        due_from, due_to = form.window(now)
        carry = [
            (key, request.POST[key])
            for key in ("team", "queue", "job", "state", "error", "group")
            if request.POST.get(key)
        ]
        carry += [
            (key, moment.replace(tzinfo=None).isoformat())
            for key, moment in (("due_from", due_from), ("due_to", due_to))
            if moment is not None
        ]
        carry.append(("failed_by", format_utc(now)))
        context = {
            "spec": spec,
            "matching": True,
            "count": filters.count([t.pk for t in chosen], states, flt),
            "described": _described(flt, chosen, states),
            "states": states,
            "mode_name": mode_name,
            "carry": carry,
            "next": request.POST.get("next", ""),
        }
        return render_page(request, "dashboard/bulk_confirm.html", context, regions=("dialog",))
    failed_by = filters.parse_instant(request.POST.get("failed_by"))
    if failed_by is not None:
        flt = dataclasses.replace(flt, failed_by=failed_by)
    # Described before the action: a group's error is read from its runs, which it changes.
    matching = "." if flt.everything else format_html(" matching {}.", _in_words(
        _described(flt, chosen, states)[1:]
    ))  # fmt: skip
    try:
        changed = transitions.act_on_matching(spec.name, chosen, states, flt, actor(request))
    except transitions.PartlyChanged as exc:  # not a 503 page over runs that were changed
        said = format_html(
            "{} {}{} {}", spec.past, plural(exc.count, "run"), matching, _not_changed(exc.spans)
        )
        return done(request, fallback, said, messages.WARNING)
    return done(
        request,
        fallback,
        format_html("{} {}{}", spec.past, plural(changed, "run"), matching),
        messages.SUCCESS if changed else messages.WARNING,
    )


def _not_changed(spans: list[str]) -> str:
    """What an action on runs of several databases says of those one failed before their
    change committed (the others' stand)."""
    return (
        f"The runs of shards {', '.join(spans)} were not changed: their database could not be "
        "reached or failed as the change was saved. Do it again to change them."
    )


def _in_words(lines: list[Described]) -> SafeString:
    """A confirmation's lines in a message, times as the page shows times (the reader's zone;
    the filter's UTC text before)."""
    return format_html_join(
        "; ", "{} {}", ((line.label, when({}, line.at) if line.at else line.text) for line in lines)
    )
