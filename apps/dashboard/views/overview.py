"""The overview: counts by state, failures, the DLQ, queue depth, latency and throughput."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse

from apps.dashboard import charts, queries
from apps.dashboard.http import HtmxHttpRequest, render_page, signed_in
from apps.runs.clock import database_now
from apps.teams import access

STATE_ORDER = ["ready", "scheduled", "leased", "retrying", "dead", "succeeded", "cancelled"]


def _per_minute(minutes: list[tuple]) -> str:
    """Attempts ended per minute over these minutes: one decimal below 10."""
    rate = sum(ok + bad for _, ok, bad in minutes) / max(1, len(minutes))
    return f"{rate:.1f}" if rate < 10 else f"{rate:,.0f}"


@signed_in
def overview(request: HtmxHttpRequest) -> HttpResponse:
    now = database_now()
    teams = list(access.visible_teams(request.user))
    chosen = request.GET.get("team", "")
    team_ids = [t.pk for t in teams if not chosen or t.slug == chosen]
    stats = queries.overview(team_ids, now)
    slugs = {t.pk: t.slug for t in teams}
    for lane in stats.queues:
        lane["team"] = slugs[lane["team_id"]]
    peak = max(stats.counts.values(), default=0)
    context = {
        "now": now,
        "teams": teams,
        "chosen_team": chosen,
        "stats": stats,
        "states": [
            (state, stats.counts.get(state, 0), charts.meter(stats.counts.get(state, 0), peak))
            for state in STATE_ORDER
        ],
        "failures_chart": charts.bar_chart(
            [[n for _, n in stats.failures_by_hour]],
            [f"{hour:%H}:00" for hour, _ in stats.failures_by_hour],
            title="Failed attempts per hour, last 24 h (UTC)",
            classes=["bar-failed"],
            tick_every=3,
        ),
        "throughput_chart": charts.bar_chart(
            [[ok for _, ok, _ in stats.per_minute], [bad for _, _, bad in stats.per_minute]],
            [f"{minute:%H:%M}" for minute, _, _ in stats.per_minute],
            title="Attempts ended per minute, last hour (UTC): succeeded and failed",
            classes=["bar-ok", "bar-failed"],
            tick_every=10,
        ),
        # The ten whole minutes before this one (it is still running): beside the chart's last
        # bars, not an hour's average that a busy quarter of an hour rounds down to 0.
        "runs_per_minute": _per_minute(stats.per_minute[-11:-1]),
        "census_seconds": settings.SCHEDULER_CENSUS_SECONDS,
        "live": True,
    }
    return render_page(request, "dashboard/overview.html", context)
