"""Workers: the worker ids seen recently with their queues, runs in flight, last lease and
heartbeat, and the leases about to expire (`apps.runs.workers`, which the API shares)."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpResponse

from apps.dashboard.http import HtmxHttpRequest, render_page, signed_in
from apps.runs import workers as seen_workers
from apps.runs.clock import database_now
from apps.teams import access

# The windows the page offers (minutes); another `?minutes=` within the API's bounds is kept.
WINDOWS = (5, 15, 60, 240, 1440)
# Leases about to expire that the page lists, soonest first.
MOST_EXPIRING = 100


@signed_in
def workers(request: HtmxHttpRequest) -> HttpResponse:
    now = database_now()
    teams = list(access.visible_teams(request.user))
    chosen = request.GET.get("team", "")
    shown = {t.pk: t for t in teams if not chosen or t.slug == chosen}
    minutes = seen_workers.parse_minutes(request.GET.get("minutes"))
    if minutes is None:
        if request.GET.get("minutes"):  # said, not just left out: say what was shown instead
            messages.warning(
                request,
                f"minutes: {seen_workers.MINUTES_RULE} Showing the default window.",
                fail_silently=True,  # the live-update socket's render has no messages
            )
        minutes = seen_workers.MINUTES_DEFAULT
    found = seen_workers.seen(list(shown), minutes, expiring=MOST_EXPIRING)
    context = {
        "now": now,
        "teams": teams,
        "chosen_team": chosen,
        "minutes": minutes,
        "window": _label(minutes),
        "windows": [(m, _label(m)) for m in sorted({*WINDOWS, minutes})],
        "workers": sorted(
            ((shown[w.team_id], w) for w in found.workers),
            key=lambda row: (row[0].slug, row[1].worker_id),
        ),
        "expiring": [(shown[lease.team_id], lease) for lease in found.expiring],
        "most_expiring": MOST_EXPIRING,
        "live": True,
    }
    return render_page(request, "dashboard/workers.html", context, regions=("page", "results"))


def _label(minutes: int) -> str:
    return f"{minutes // 60} h" if minutes % 60 == 0 else f"{minutes} min"
