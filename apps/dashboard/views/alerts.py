"""Late and missed runs (`apps.jobs.alerts`) of every team the user sees: a page, and the panel
the overview loads into itself."""

from __future__ import annotations

from django.http import HttpResponse

from apps.dashboard.http import HtmxHttpRequest, render_page, signed_in
from apps.jobs import alerts as late_and_missed
from apps.runs.clock import database_now
from apps.teams import access

# The page lists this many, the overview's panel fewer (`?limit=`); the rest are counted.
MOST_SHOWN = 200


@signed_in
def alerts(request: HtmxHttpRequest) -> HttpResponse:
    now = database_now()
    teams = list(access.visible_teams(request.user))
    chosen = request.GET.get("team", "")
    try:
        limit = max(1, min(MOST_SHOWN, int(request.GET.get("limit", MOST_SHOWN))))
    except ValueError:
        limit = MOST_SHOWN
    found, total = [], 0
    for team in teams:
        if not chosen or team.slug == chosen:
            of_team = late_and_missed.alerts_for(team, now, limit=limit)
            found += [(team, alert) for alert in of_team.alerts]
            total += of_team.total
    found.sort(key=lambda item: item[1].position, reverse=True)
    rows = [
        {"team": team, "alert": alert, "about": alert.as_json()} for team, alert in found[:limit]
    ]
    context = {
        "now": now,
        "teams": teams,
        "chosen_team": chosen,
        "rows": rows,
        "hidden": total - len(rows),
        # The overview's panel links to the page for the rest; the page itself has no more
        # to show (its link led back to itself).
        "whole_page": limit == MOST_SHOWN,
        "window_hours": int(late_and_missed.WINDOW.total_seconds() // 3600),
    }
    return render_page(request, "dashboard/alerts.html", context, regions=("alerts-table",))
