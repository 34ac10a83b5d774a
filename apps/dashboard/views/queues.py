"""Queues: depth per priority, the oldest ready run's age, pause and resume."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_POST

from apps.dashboard import queries
from apps.dashboard.http import (
    HtmxHttpRequest,
    actor,
    already,
    done,
    record_refused,
    render_page,
    signed_in,
)
from apps.jobs import services
from apps.runs import limits
from apps.teams import access
from apps.teams.models import Role, Team


@signed_in
def queues(request: HtmxHttpRequest) -> HttpResponse:
    now = services.database_now()
    teams = list(access.visible_teams(request.user))
    chosen = request.GET.get("team", "")
    shown = [t for t in teams if not chosen or t.slug == chosen]
    rows, counted_at = queries.queues(shown, now)
    context = {
        "now": now,
        "teams": teams,
        "chosen_team": chosen,
        "queues": rows,
        "counted_at": counted_at,
        "census_seconds": settings.SCHEDULER_CENSUS_SECONDS,
        "priorities": ["critical", "default", "bulk"],
        "live": True,
    }
    return render_page(request, "dashboard/queues.html", context, regions=("page", "results"))


@require_POST
@signed_in
def queue_pause(request: HtmxHttpRequest, team: str, queue: str, paused: bool) -> HttpResponse:
    owner = Team.objects.filter(slug=team).first()
    if owner is None or owner.pk not in access.visible_team_ids(request.user):
        if owner is not None:
            record_refused(request, owner, "queue", queue)
        raise Http404("No such team.")
    access.require_role(request.user, owner, Role.OPERATOR)
    # A name the team has no queue of (typed by hand) would make a new queue, paused.
    if limits.queue_name_problem(queue) is not None or not queries.queue_known(owner, queue):
        raise Http404("No such queue.")
    _, changed = services.set_queue_paused(owner, queue, paused, actor(request))
    what = f"Queue {queue} of {owner.slug}"
    if not changed:  # a page left open while someone else paused or resumed it
        event = queries.paused_by(owner.pk, "queue", queue, paused)
        state = "paused" if paused else "running"
        return done(
            request, reverse("dashboard:queues"), already(what, state, event), messages.INFO
        )
    verb = "Paused" if paused else "Resumed"
    return done(request, reverse("dashboard:queues"), f"{verb} queue {queue} of {owner.slug}.")
