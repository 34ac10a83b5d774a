"""Teams: the user's teams and roles; for admins, members, API tokens and notification
channels (apps/dashboard/views/channels.py)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.db.models import QuerySet
from django.http import Http404, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_POST

from apps.dashboard.forms import MemberForm, TokenForm
from apps.dashboard.http import (
    HtmxHttpRequest,
    actor,
    done,
    record_refused,
    render_page,
    signed_in,
)
from apps.dashboard.views import channels as channel_views
from apps.teams import access, services
from apps.teams.models import ApiToken, Membership, Role, Team

BIGINT = 2**63 - 1  # a larger id is no key of ours (and no bigint at all)

# The create-token forms already sent, by the one-time value each page gives its form: sent
# again (a reload of the answer, Back), it makes no second token. The last few are enough.
SENT_TOKEN_FORMS_KEY = "dashboard_sent_token_forms"
SENT_TOKEN_FORMS_KEPT = 20


@signed_in
def teams(request: HtmxHttpRequest) -> HttpResponse:
    roles = access.team_roles(request.user)
    rows = [(team, roles[team.pk]) for team in access.visible_teams(request.user)]
    return render_page(request, "dashboard/teams.html", {"rows": rows})


def _team(request: HtmxHttpRequest, slug: str, role: str | None = Role.ADMIN) -> Team:
    """The team of the page if the user sees it (a 404 otherwise) and holds `role` in it (a
    403 otherwise; None: seeing it is enough)."""
    team = Team.objects.filter(slug=slug).first()
    if team is not None and team.pk not in access.visible_team_ids(request.user):
        record_refused(request, team, "team", slug)  # another team's: recorded, and a 404
        team = None
    if team is None:
        raise Http404("No such team.")
    if role is not None:
        access.require_role(request.user, team, role)
    return team


@signed_in
def team_detail(request: HtmxHttpRequest, slug: str) -> HttpResponse:
    # Every member reads who is in the team, its tokens (never their secrets) and where it is
    # paged; only its admins change them.
    return team_detail_page(request, _team(request, slug, role=None))


def owned(
    request: HtmxHttpRequest,
    team: Team,
    rows: QuerySet,
    pk: int,
    kind: str,
    name: Callable[[Any], str],
) -> Any:
    """The team's row `pk` of `rows` (a 404 otherwise). A row of a team the user does not see
    is answered as a missing one, and the attempt recorded as on runs and jobs: `name(row)`
    names it in the trail."""
    found = rows.select_related("team").filter(pk=pk).first() if pk <= BIGINT else None
    if found is not None and found.team_id != team.pk:
        if found.team_id not in access.visible_team_ids(request.user):
            record_refused(request, found.team, kind, name(found))
        found = None
    if found is None:
        raise Http404(f"No such {kind}.")
    return found


def team_detail_page(
    request: HtmxHttpRequest, team: Team, *, channel_form=None, new_token: dict | None = None
) -> HttpResponse:
    """The team page: members, tokens and notification channels (`channel_form`: the create
    form with its errors; `new_token`: the token just created, with its secret)."""
    context = {
        "team": team,
        "can_admin": access.has_role(request.user, team, Role.ADMIN),
        "members": Membership.objects.filter(team=team)
        .select_related("user")
        .order_by("user__username"),
        "tokens": ApiToken.objects.filter(team=team)
        .select_related("created_by")
        .order_by("-created_at"),
        "member_form": MemberForm(),
        "token_form": TokenForm(),
        "roles": Role.choices,
        "new_token": new_token,
        "token_form_once": secrets.token_urlsafe(16),
        **channel_views.team_context(request, team, channel_form),
    }
    return render_page(request, "dashboard/team_detail.html", context)


def _back(slug: str) -> str:
    return reverse("dashboard:team", args=[slug])


@require_POST
@signed_in
def member_set(request: HtmxHttpRequest, slug: str) -> HttpResponse:
    team = _team(request, slug)
    form = MemberForm(request.POST)
    if not form.is_valid():
        return done(request, _back(slug), "Give a username and a role.", messages.ERROR)
    try:
        services.set_member(
            team, form.cleaned_data["username"], form.cleaned_data["role"], actor(request)
        )
    except services.TeamChangeError as exc:
        return done(request, _back(slug), str(exc), messages.ERROR)
    access.forget(request.user)
    return done(
        request, _back(slug), f"{form.cleaned_data['username']} is now {form.cleaned_data['role']}."
    )


@require_POST
@signed_in
def member_remove(request: HtmxHttpRequest, slug: str, member_id: int) -> HttpResponse:
    team = _team(request, slug)
    members = Membership.objects.select_related("user")
    membership = owned(request, team, members, member_id, "member", lambda m: m.user.get_username())
    try:
        services.remove_member(membership, actor(request))
    except services.TeamChangeError as exc:
        return done(request, _back(slug), str(exc), messages.ERROR)
    access.forget(request.user)
    # Who removed themselves no longer sees the team: its page was a 404 after the removal.
    gone = not access.visible_teams(request.user).filter(pk=team.pk).exists()
    after = reverse("dashboard:teams") if gone else _back(slug)
    return done(request, after, f"Removed {membership.user.get_username()}.")


@require_POST
@signed_in
def token_create(request: HtmxHttpRequest, slug: str) -> HttpResponse:
    team = _team(request, slug)
    form = TokenForm(request.POST)
    if not form.is_valid():
        said = "; ".join(
            f"{'Name' if field == 'name' else 'Scopes'}: {' '.join(errors)}"
            for field, errors in form.errors.items()
        )
        return done(request, _back(slug), said, messages.ERROR)
    once = request.POST.get("once", "")[:64]
    sent = request.session.get(SENT_TOKEN_FORMS_KEY, [])
    if once and once in sent:
        return done(
            request,
            _back(slug),
            "This form was sent already: its token was made then and shown once.",
            messages.WARNING,
        )
    try:
        token, raw = services.issue_token(
            team, form.cleaned_data["scopes"], actor(request), name=form.cleaned_data["name"]
        )
    except services.TeamChangeError as exc:
        return done(request, _back(slug), str(exc), messages.ERROR)
    if once:
        request.session[SENT_TOKEN_FORMS_KEY] = [*sent, once][-SENT_TOKEN_FORMS_KEPT:]
    # The secret is in this answer alone: kept in the session for the page after a redirect,
    # it stayed in the session table until that page was opened, and Back showed it again.
    response = team_detail_page(
        request, team, new_token={"raw": raw, "prefix": token.prefix, "name": token.name}
    )
    response["Cache-Control"] = "no-store"
    return response


@require_POST
@signed_in
def token_revoke(request: HtmxHttpRequest, slug: str, token_id: int) -> HttpResponse:
    team = _team(request, slug)
    token = owned(request, team, ApiToken.objects, token_id, "token", lambda t: t.prefix)
    try:
        services.revoke_token(token, actor(request))
    except services.TeamChangeError as exc:
        return done(request, _back(slug), str(exc), messages.ERROR)
    return done(request, _back(slug), f"Revoked token {token.prefix}….")
