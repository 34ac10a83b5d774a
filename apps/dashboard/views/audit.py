"""The audit trail: every change from the dashboard, the API and the CLI; read-only here."""

from __future__ import annotations

from django.http import HttpResponse

from apps.dashboard import queries
from apps.dashboard.forms import RANGES, AuditFilterForm
from apps.dashboard.http import HtmxHttpRequest, render_page, signed_in
from apps.runs.clock import database_now
from apps.teams import access


@signed_in
def audit(request: HtmxHttpRequest) -> HttpResponse:
    now = database_now()
    teams = list(access.visible_teams(request.user))
    form = AuditFilterForm(request.GET, teams=teams)
    events, next_cursor = [], None
    if form.is_valid():
        data = form.cleaned_data
        chosen = data["team"]
        flt = queries.AuditFilter(
            team_ids=[t.pk for t in teams if not chosen or t.slug == chosen],
            # Events of no team (a user's own sign-in changes, system events) are for staff.
            include_teamless=request.user.is_staff and not chosen,
            actor=data["actor"].strip(),
            action=data["action"],
            target=data["target"].strip(),
            source=data["source"],
            since=now - RANGES[data["range"]] if data["range"] else None,
        )
        events, next_cursor = queries.audit_page(flt, before=data["cursor"])
    context = {"now": now, "form": form, "events": events, "next_cursor": next_cursor}
    return render_page(request, "dashboard/audit.html", context, regions=("page", "results"))
