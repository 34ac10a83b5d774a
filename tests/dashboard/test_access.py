"""Roles, team isolation, sign-in, CSRF and escaping, checked on the server with hand-made requests."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from apps.audit.models import AuditEvent
from apps.jobs.models import JobDefinition, Queue
from apps.notify.models import Channel
from apps.runs.models import Run
from apps.teams.models import ApiToken, Membership
from tests.dashboard.conftest import XSS, client_for, failed_runs, make_user

pytestmark = pytest.mark.django_db(transaction=True)

PAGES = [
    "/",
    "/failures",
    "/runs",
    "/dlq",
    "/jobs",
    "/jobs/new",
    "/queues",
    "/audit",
    "/teams",
]


def test_signed_out_requests_redirect_to_sign_in(job_a):
    (run,) = failed_runs(job_a)
    client = Client()
    pages = [
        *PAGES,
        f"/runs/{run.run_id}",
        f"/jobs/{job_a.name}",
        f"/jobs/{job_a.name}/edit",
        "/teams/team-a",
    ]
    for path in pages:
        response = client.get(path)
        assert response.status_code == 302, path
        assert response["Location"].startswith("/accounts/login/?next="), path
    posts = [
        f"/runs/{run.run_id}/requeue",
        "/runs/bulk",
        f"/jobs/{job_a.name}/pause",
        f"/jobs/{job_a.name}/edit",
        "/queues/team-a/billing/pause",
        "/teams/team-a/tokens",
    ]
    for path in posts:
        response = client.post(path, {"ids": [run.run_id], "action": "requeue", "confirm": "yes"})
        assert response.status_code == 302, path
        assert response["Location"].startswith("/accounts/login/"), path
    run.refresh_from_db()
    job_a.refresh_from_db()
    assert run.state == "dead" and not job_a.paused
    assert client.get("/accounts/login/").status_code == 200


def test_an_htmx_request_signed_out_gets_a_client_redirect():
    response = Client().get("/failures", HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    assert response["HX-Redirect"] == "/accounts/login/"


def test_an_action_sent_after_the_session_ended_signs_in_back_to_its_page():
    """The sign-in page came back to the overview: the list, its filter and the ticked rows
    the action was sent from were gone."""
    page = "http://testserver/dlq?job=billing.export&since=24h"
    response = Client().post("/runs/bulk", HTTP_HX_REQUEST="true", HTTP_HX_CURRENT_URL=page)
    assert (
        response["HX-Redirect"]
        == "/accounts/login/?next=%2Fdlq%3Fjob%3Dbilling.export%26since%3D24h"
    )
    # Only a path of this site is carried.
    elsewhere = Client().post(
        "/runs/bulk", HTTP_HX_REQUEST="true", HTTP_HX_CURRENT_URL="javascript:alert(1)"
    )
    assert elsewhere["HX-Redirect"] == "/accounts/login/"
    other_host = Client().post(
        "/runs/bulk",
        HTTP_HX_REQUEST="true",
        HTTP_HX_CURRENT_URL="http://testserver//evil.example/x",
    )
    assert other_host["HX-Redirect"] == "/accounts/login/"


def test_a_viewer_cannot_retry_pause_or_edit_even_by_hand(viewer_a, job_a):
    (run,) = failed_runs(job_a)
    client = client_for(viewer_a)
    assert client.get(f"/runs/{run.run_id}").status_code == 200  # a viewer reads
    assert client.post(f"/runs/{run.run_id}/retry").status_code == 403
    assert client.post(f"/runs/{run.run_id}/requeue").status_code == 403
    bulk = {"action": "retry", "ids": [run.run_id], "confirm": "yes"}
    assert client.post("/runs/bulk", bulk).status_code == 403
    assert client.post(f"/jobs/{job_a.name}/pause").status_code == 403
    assert client.post(f"/jobs/{job_a.name}/trigger").status_code == 403
    assert client.post("/queues/team-a/billing/pause").status_code == 403
    assert client.get(f"/jobs/{job_a.name}/edit").status_code == 403
    edit = {"team": "team-a", "name": job_a.name, "kind": "none", "queue": "q", "priority": "default",
            "timeout_seconds": 60, "retry_max_attempts": 1, "retry_base_seconds": 1,
            "retry_max_seconds": 1, "payload": "{}"}  # fmt: skip
    assert client.post(f"/jobs/{job_a.name}/edit", edit).status_code == 403
    assert client.post("/jobs/new", {**edit, "name": "billing.other"}).status_code == 403
    assert (
        client.post(f"/jobs/{job_a.name}/delete", {"confirm_name": job_a.name}).status_code == 403
    )
    # The team page is read by every member; its changes are the admins'.
    team_page = client.get("/teams/team-a")
    assert team_page.status_code == 200
    body = team_page.content.decode()
    for action in ("team-a/members", "team-a/tokens", "team-a/channels", "Create token"):
        assert action not in body, action
    assert client.post("/teams/team-a/tokens", {"scopes": ["worker"]}).status_code == 403
    run.refresh_from_db()
    job_a.refresh_from_db()
    assert run.state == "dead"
    assert not job_a.paused and job_a.queue == "billing"
    assert not JobDefinition.objects.filter(name="billing.other").exists()
    assert not AuditEvent.objects.filter(source="dashboard").exists()


def test_a_viewer_sees_no_action_buttons(viewer_a, job_a):
    (run,) = failed_runs(job_a)
    client = client_for(viewer_a)
    body = client.get(f"/runs/{run.run_id}").content.decode()
    assert f"/runs/{run.run_id}/requeue" not in body
    assert "Retry selected" not in client.get("/failures").content.decode()


def test_an_operator_of_team_a_cannot_see_team_b_runs(operator_a, job_a, job_b):
    (mine,) = failed_runs(job_a, prefix="a")
    (theirs,) = failed_runs(job_b, prefix="b")
    client = client_for(operator_a)
    for path in ("/failures", "/runs", "/dlq", "/jobs", "/queues", "/", "/audit"):
        body = client.get(path).content.decode()
        assert theirs.run_id not in body, path
        assert "search.reindex" not in body, path
    assert mine.run_id in client.get("/dlq").content.decode()
    assert client.get(f"/runs/{theirs.run_id}").status_code == 404
    assert client.get(f"/jobs/{job_b.name}").status_code == 404
    assert client.post(f"/runs/{theirs.run_id}/requeue").status_code == 404
    assert client.post(f"/jobs/{job_b.name}/pause").status_code == 404
    assert client.post("/queues/team-b/search/pause").status_code == 404
    # Another team's id slipped into a bulk action is ignored, not acted on.
    response = client.post(
        "/runs/bulk", {"action": "requeue", "ids": [mine.run_id, theirs.run_id], "confirm": "yes"}
    )
    assert response.status_code == 302
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert mine.state == "ready" and theirs.state == "dead"
    # Every attempt on team B's objects is in team B's audit trail, as the API's are.
    denied = AuditEvent.objects.filter(action="access.denied").order_by("pk")
    assert [(e.team.slug, e.target_type, e.target, e.source) for e in denied] == [
        ("team-b", "run", theirs.run_id, "dashboard"),
        ("team-b", "job", job_b.name, "dashboard"),
        ("team-b", "run", theirs.run_id, "dashboard"),
        ("team-b", "job", job_b.name, "dashboard"),
        ("team-b", "queue", "search", "dashboard"),
        ("team-b", "run", theirs.run_id, "dashboard"),
    ]
    assert denied.last().after["attempted"] == "POST /runs/bulk"
    assert denied.last().actor == operator_a.username


def test_an_admin_acting_on_another_teams_members_tokens_and_channels_is_recorded(admin_a, team_b):
    """Forged POSTs at team B's people, tokens and channels: 404s, nothing changed, each
    attempt in team B's trail (through team B's pages, or team A's with B's ids)."""
    bob = make_user("bob-admin", team_b, "admin")
    member = Membership.objects.get(user=bob, team=team_b)
    token, _ = ApiToken.issue(team_b, ["manage"], name="deploy")
    channel = Channel.objects.create(
        team=team_b, name="pager", kind="email", target="b@example.com", events=["run.dead"]
    )
    client = client_for(admin_a)
    before = {"members": 1, "tokens": 1, "channels": 1}
    attempts = [
        ("/teams/team-b", "team", "team-b"),
        (f"/teams/team-b/members/{member.pk}/remove", "team", "team-b"),
        (f"/teams/team-a/members/{member.pk}/remove", "member", "bob-admin"),
        (f"/teams/team-a/tokens/{token.pk}/revoke", "token", token.prefix),
        (f"/teams/team-a/channels/{channel.pk}/delete", "channel", str(channel.pk)),
        (f"/teams/team-a/channels/{channel.pk}/enable", "channel", str(channel.pk)),
        (f"/teams/team-a/members/{2**63}/remove", None, None),  # no such id, nothing recorded
    ]
    for path, _, _ in attempts:
        response = client.get(path) if path == "/teams/team-b" else client.post(path)
        assert response.status_code == 404, path
    after = {
        "members": Membership.objects.filter(team=team_b).count(),
        "tokens": ApiToken.objects.filter(team=team_b, revoked_at__isnull=True).count(),
        "channels": Channel.objects.filter(team=team_b, enabled=True).count(),
    }
    assert after == before
    denied = AuditEvent.objects.filter(action="access.denied").order_by("pk")
    assert [(e.team.slug, e.target_type, e.target) for e in denied] == [
        ("team-b", kind, target) for _, kind, target in attempts if kind
    ]
    assert {e.actor for e in denied} == {admin_a.username}


def test_an_operator_retries_and_the_audit_names_the_dashboard(operator_a, job_a):
    (run,) = failed_runs(job_a)
    response = client_for(operator_a).post(f"/runs/{run.run_id}/retry")
    assert response.status_code == 302
    assert response["Location"] == f"/runs/{run.run_id}"
    run.refresh_from_db()
    assert run.state == "ready"
    event = AuditEvent.objects.get(target=run.run_id)
    assert (event.action, event.source, event.actor) == (
        "dlq.requeue",
        "dashboard",
        "oscar-operator",
    )


def test_staff_see_every_team_but_change_nothing_without_a_role(job_a, job_b):
    from tests.dashboard.conftest import make_user

    staff = make_user("sam-staff", is_staff=True)
    (theirs,) = failed_runs(job_b)
    client = client_for(staff)
    assert theirs.run_id in client.get("/dlq").content.decode()
    assert client.post(f"/runs/{theirs.run_id}/requeue").status_code == 403


def test_a_post_without_a_csrf_token_is_refused(operator_a, job_a):
    (run,) = failed_runs(job_a)
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator_a)
    response = client.post(f"/runs/{run.run_id}/retry")
    assert response.status_code == 403
    assert b"CSRF" in response.content
    run.refresh_from_db()
    assert run.state == "dead"
    # With the token the page gave it, the same request goes through.
    client.get(f"/runs/{run.run_id}")
    token = client.cookies["csrftoken"].value
    assert client.post(f"/runs/{run.run_id}/retry", HTTP_X_CSRFTOKEN=token).status_code == 302


def test_payloads_and_errors_render_as_text(viewer_a, job_a):
    (run,) = failed_runs(job_a, message=f"{XSS} failed", payload={"html": XSS})
    client = client_for(viewer_a)
    for path in (f"/runs/{run.run_id}", "/failures", "/dlq", f"/jobs/{job_a.name}"):
        body = client.get(path).content.decode()
        assert XSS not in body, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body, path


def test_a_run_whose_stored_payload_cannot_be_read_still_has_its_page(viewer_a, job_a):
    (run,) = failed_runs(job_a)
    Run.objects.filter(pk=run.pk).update(payload=None, payload_key="payloads/gone.json")
    body = client_for(viewer_a).get(f"/runs/{run.run_id}").content.decode()
    assert "Unreadable: the payload payloads/gone.json cannot be read from storage" in body


def test_every_page_sends_a_csp_without_inline_script(viewer_a):
    client = client_for(viewer_a)
    for path in [*PAGES[:4], "/accounts/login/"]:
        response = client.get(path)
        policy = response["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert "<script>" not in response.content.decode()  # no inline script element at all


def test_not_found_is_html_for_people_and_json_for_the_api(viewer_a):
    client = client_for(viewer_a)
    page = client.get("/runs/run_ZZZZZZ")
    assert page.status_code == 404 and page["Content-Type"].startswith("text/html")
    api = client.get("/api/v1/nothing-here")
    assert api.status_code == 404 and api["Content-Type"] == "application/problem+json"


def test_list_pages_never_count_the_runs_table(operator_a, job_a):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    failed_runs(job_a, 3)
    client = client_for(operator_a)
    for path in ("/failures", "/runs", "/dlq", "/runs?state=ready", "/jobs", "/audit"):
        with CaptureQueriesContext(connection) as captured:
            assert client.get(path).status_code == 200
        counts = [q["sql"] for q in captured if "COUNT(" in q["sql"].upper()]
        assert counts == [], (path, counts)
    assert reverse("dashboard:failures") == "/failures"
    assert Run.objects.count() == 3


def test_names_no_job_or_queue_can_have_are_not_found(operator_a, job_a):
    # PostgreSQL text cannot hold NUL: each of these once answered 500.
    viewer = client_for(operator_a)
    for path in ("/jobs/%00", "/jobs/a%00", "/jobs/%00/edit", "/jobs/Not%20A%20Job"):
        assert viewer.get(path).status_code == 404, path
    assert viewer.post("/jobs/a%00/trigger").status_code == 404
    for query in ("q=%00", "q=a%00b", "after=%00"):
        page = viewer.get(f"/jobs?{query}")
        assert page.status_code == 200 and job_a.name not in page.content.decode(), query
    assert job_a.name in viewer.get("/jobs?q=billing").content.decode()
    # Nor one the team has not (a name typed by hand would make a new queue, paused).
    for queue in ("bad%20queue!", "%00", "q" * 300, "billing-typo"):
        assert viewer.post(f"/queues/team-a/{queue}/pause").status_code == 404, queue
    assert not Queue.objects.exists()
    assert not AuditEvent.objects.filter(action="queue.pause").exists()
    assert viewer.post(f"/queues/team-a/{job_a.queue}/pause").status_code == 302
    assert Queue.objects.get().paused


def test_a_filter_no_run_can_match_is_said_to_be_wrong(viewer_a, job_a):
    client = client_for(viewer_a)
    for path, field in (
        ("/runs?queue=%00", "queue"),
        ("/dlq?job=a%20b", "job"),
        ("/audit?source=bogus", "source"),
    ):
        answer = client.get(path)
        body = answer.content.decode()
        assert answer.status_code == 200 and 'class="errorlist" role="alert">' in body, path
        assert f"{field}: " in body.split('class="errorlist" role="alert">')[1], path
    workers = client.get("/workers?minutes=99999").content.decode()
    assert "minutes: A whole number of minutes from 1 to" in workers


def test_a_stale_pause_or_resume_says_who_did_it_already(operator_a, admin_a, job_a):
    """A page left open while someone else paused (resumed) the job or its queue: the second
    click changes nothing, writes nothing, and says so, naming who did it."""
    first, second = client_for(admin_a), client_for(operator_a)

    def said(client: Client, path: str) -> str:
        response = client.post(path, follow=True)
        assert response.status_code == 200, path
        return " ".join(str(m) for m in response.context["messages"])

    queue = f"/queues/team-a/{job_a.queue}"
    for path, verb, state, what in [
        (f"/jobs/{job_a.name}/pause", "Paused", "paused", job_a.name),
        (f"/jobs/{job_a.name}/resume", "Resumed", "running", job_a.name),
        (f"{queue}/pause", "Paused", "paused", f"Queue {job_a.queue} of team-a"),
        (f"{queue}/resume", "Resumed", "running", f"Queue {job_a.queue} of team-a"),
    ]:
        assert said(first, path).startswith(f"{verb} ")
        events = AuditEvent.objects.count()
        again = said(second, path)
        assert again.startswith(f"{what} was {state} already (by {admin_a.username} at ")
        assert again.endswith("nothing changed.") and AuditEvent.objects.count() == events


def test_a_stale_pause_names_who_paused_by_any_means(operator_a, job_a):
    """The queue paused through its settings (an edit of its rate limit too), then its rate
    limit edited by another: a stale pause names the one who paused it."""
    from apps.audit.record import Actor
    from apps.jobs import services

    team, queue = job_a.team, job_a.queue
    services.set_queue_settings(
        team, queue, Actor.cli("deploy-bot"), rate_limit=(5, 60), paused=True
    )
    services.set_queue_settings(team, queue, Actor.cli("tuner"), rate_limit=(9, 60), paused=None)
    response = client_for(operator_a).post(f"/queues/team-a/{queue}/pause", follow=True)
    said = " ".join(str(m) for m in response.context["messages"])
    assert "was paused already (by deploy-bot at " in said, said
