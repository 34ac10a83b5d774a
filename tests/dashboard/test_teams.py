"""Members and API tokens, managed by a team's admins through apps.teams.services."""

from __future__ import annotations

import pytest

from apps.audit.models import AuditEvent
from apps.teams.models import ApiToken, Membership
from tests.dashboard.conftest import client_for, make_user

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_new_token_is_shown_once_and_only_its_hash_is_kept(admin_a, team_a):
    """Shown in the answer to its creation alone: kept in the session for the page after a
    redirect, the secret stayed in the session table until that page was opened, and the
    browser's Back showed it again (the page was cacheable)."""
    from django.contrib.sessions.models import Session

    client = client_for(admin_a)
    page = client.get("/teams/team-a").content.decode()
    once = page.split('name="once" value="')[1].split('"')[0]
    form = {"name": "billing workers", "scopes": ["worker"], "once": once}
    response = client.post("/teams/team-a/tokens", form)
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    token = ApiToken.objects.get(team=team_a)
    shown = response.content.decode()
    raw = shown.split("<code>")[1].split("</code>")[0]
    assert raw.startswith(token.prefix) and token.matches(raw)
    assert "New token billing workers" in shown
    assert raw not in client.get("/teams/team-a").content.decode()  # never again
    for session in Session.objects.all():
        assert raw not in str(session.get_decoded())
    assert (token.name, token.scopes, token.created_by) == ("billing workers", ["worker"], admin_a)
    event = AuditEvent.objects.get(action="token.create")
    assert (event.source, event.target) == ("dashboard", token.prefix)
    assert raw not in str(event.after)
    # The same form sent again (a reload of the answer, Back) makes no second token.
    again = client.post("/teams/team-a/tokens", form, follow=True).content.decode()
    assert "This form was sent already" in again and "<code>" not in again
    assert ApiToken.objects.filter(team=team_a).count() == 1


def test_a_token_named_with_control_or_direction_characters_is_refused(admin_a, team_a):
    client = client_for(admin_a)
    for name in ("a\x01b\x1b[31m", "\u202eevil", "a\u200fb", "a\u061cb"):
        said = client.post(
            "/teams/team-a/tokens", {"name": name, "scopes": ["worker"]}, follow=True
        ).content.decode()
        assert "No control or text-direction characters." in said
    assert not ApiToken.objects.filter(team=team_a).exists()


def test_a_deactivated_admin_does_not_keep_a_team_administered(admin_a, team_a):
    """The last-admin guard counted an account that cannot sign in: the team was left to it."""
    ghost = make_user("ghost-admin", team_a, "admin")
    ghost.is_active = False
    ghost.save()
    client = client_for(admin_a)
    said = client.post(
        "/teams/team-a/members", {"username": admin_a.username, "role": "viewer"}, follow=True
    ).content.decode()
    assert "A team keeps at least one admin." in said
    assert "(deactivated: cannot sign in)" in said
    assert Membership.objects.get(team=team_a, user=admin_a).role == "admin"


def test_an_admin_who_removes_themselves_lands_on_their_teams(admin_a, team_a):
    make_user("other-admin", team_a, "admin")
    client = client_for(admin_a)
    mine = Membership.objects.get(team=team_a, user=admin_a)
    answer = client.post(f"/teams/team-a/members/{mine.pk}/remove")
    assert answer.status_code == 302 and answer["Location"] == "/teams"
    assert "Removed " in client.get("/teams").content.decode()


def test_two_admins_demoting_each_other_at_once_leave_one_admin(admin_a, team_a):
    from apps.audit.record import Actor
    from apps.teams import services
    from tests.runs.test_claim_concurrency import run_in_threads

    other = make_user("other-admin")
    pairs = [(admin_a, other), (other, admin_a)]

    def demote(index: int) -> bool:
        by, whom = pairs[index]
        try:
            services.set_member(team_a, whom.username, "viewer", Actor.for_user(by))
        except services.TeamChangeError:
            return False
        return True

    for _ in range(10):
        Membership.objects.update_or_create(team=team_a, user=other, defaults={"role": "admin"})
        Membership.objects.filter(team=team_a, user=admin_a).update(role="admin")
        assert sorted(run_in_threads(2, demote)) == [False, True]
        assert Membership.objects.filter(team=team_a, role="admin").count() == 1


def test_an_admin_demoted_while_their_request_was_on_its_way_changes_nothing(admin_a, team_a):
    """The view let the request in as an admin's; another admin's change committed first."""
    from apps.audit.record import Actor
    from apps.teams import services

    other = make_user("other-admin")
    Membership.objects.create(user=other, team=team_a, role="admin")
    by = Actor.for_user(admin_a)
    assert services.issue_token(team_a, ["worker"], by)  # as an admin, before the demotion
    (token,) = ApiToken.objects.filter(team=team_a)
    services.set_member(team_a, admin_a.username, "viewer", Actor.for_user(other))
    changes = [
        lambda: services.issue_token(team_a, ["worker"], by),
        lambda: services.revoke_token(token, by),
        lambda: services.set_member(team_a, other.username, "viewer", by),
        lambda: services.remove_member(Membership.objects.get(user=other), by),
    ]
    for change in changes:
        with pytest.raises(services.TeamChangeError, match="no longer an admin"):
            change()
    assert ApiToken.objects.filter(team=team_a, revoked_at__isnull=True).count() == 1
    assert Membership.objects.get(user=other).role == "admin"


def test_a_token_form_error_names_the_field_that_is_wrong(admin_a, team_a):
    client = client_for(admin_a)
    long_name = client.post(
        "/teams/team-a/tokens", {"name": "n" * 101, "scopes": ["worker"]}, follow=True
    ).content.decode()
    assert "Name: Ensure this value has at most 100 characters" in long_name
    no_scope = client.post("/teams/team-a/tokens", {"name": "x"}, follow=True).content.decode()
    assert "Scopes: This field is required." in no_scope
    assert not ApiToken.objects.filter(team=team_a).exists()


def test_revoking_a_token_stops_it_and_is_audited(admin_a, team_a):
    token, _ = ApiToken.issue(team_a, ["worker"], name="old")
    client = client_for(admin_a)
    assert client.post(f"/teams/team-a/tokens/{token.pk}/revoke").status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert AuditEvent.objects.filter(action="token.revoke", target=token.prefix).count() == 1
    client.post(f"/teams/team-a/tokens/{token.pk}/revoke")  # twice is still one revocation
    assert AuditEvent.objects.filter(action="token.revoke").count() == 1


def test_members_are_added_changed_and_removed_with_an_audit_trail(admin_a, team_a):
    make_user("newcomer")
    client = client_for(admin_a)
    client.post("/teams/team-a/members", {"username": "newcomer", "role": "viewer"})
    client.post("/teams/team-a/members", {"username": "newcomer", "role": "operator"})
    membership = Membership.objects.get(team=team_a, user__username="newcomer")
    assert membership.role == "operator"
    client.post(f"/teams/team-a/members/{membership.pk}/remove")
    assert not Membership.objects.filter(pk=membership.pk).exists()
    trail = list(
        AuditEvent.objects.filter(target="newcomer")
        .order_by("pk")
        .values_list("action", "before", "after")
    )
    assert trail == [
        ("member.set", None, {"role": "viewer"}),
        ("member.set", {"role": "viewer"}, {"role": "operator"}),
        ("member.remove", {"role": "operator"}, None),
    ]


def test_the_last_admin_cannot_be_demoted(admin_a, team_a):
    response = client_for(admin_a).post(
        "/teams/team-a/members", {"username": admin_a.username, "role": "viewer"}, follow=True
    )
    assert "at least one admin" in response.content.decode()
    assert Membership.objects.get(user=admin_a).role == "admin"


def test_only_admins_manage_members_and_tokens(editor_a, team_a):
    client = client_for(editor_a)
    # An editor reads the team page, without its forms; the changes are refused.
    page = client.get("/teams/team-a")
    assert page.status_code == 200 and "Create token" not in page.content.decode()
    assert client.post("/teams/team-a/tokens", {"scopes": ["manage"]}).status_code == 403
    assert (
        client.post(
            "/teams/team-a/members", {"username": editor_a.username, "role": "admin"}
        ).status_code
        == 403
    )
    assert not ApiToken.objects.exists()
    assert Membership.objects.get(user=editor_a).role == "editor"
