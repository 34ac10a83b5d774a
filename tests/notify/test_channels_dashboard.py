"""The team page's channels through Django's test client: team admins only, another team's
channel is a 404, every change audited as the dashboard's."""

from __future__ import annotations

import pytest

from apps.audit.models import AuditEvent
from apps.notify.models import Channel, Delivery
from tests.dashboard.conftest import client_for, make_user
from tests.notify.conftest import make_channel

pytestmark = pytest.mark.django_db


def form(**fields) -> dict:
    return {
        "name": "mail",
        "kind": "email",
        "target": "oncall@example.com",
        "events": ["run.dead", "job.recovered"],
        "jobs": "billing.export, billing.import",
        "queues": "",
        **fields,
    }


def test_an_admin_creates_disables_and_deletes_a_channel_each_audited(admin_a, smtp):
    client = client_for(admin_a)
    created = client.post("/teams/team-a/channels", form())
    assert created.status_code == 302 and created["Location"] == "/teams/team-a#channels"
    channel = Channel.objects.get()
    assert channel.jobs == ["billing.export", "billing.import"] and channel.queues == []
    page = client.get("/teams/team-a").content.decode()
    assert "Notification channels" in page and "oncall@example.com" in page

    tested = client.post(f"/teams/team-a/channels/{channel.pk}/test")
    assert tested.status_code == 302 and len(smtp.envelopes) == 1
    log = client.get(f"/teams/team-a/channels/{channel.pk}").content.decode()
    assert 'data-state="sent"' in log and "accepted for oncall@example.com" in log

    client.post(f"/teams/team-a/channels/{channel.pk}/enable", {"enabled": "0"})
    channel.refresh_from_db()
    assert channel.enabled is False
    client.post(f"/teams/team-a/channels/{channel.pk}/delete")
    assert not Channel.objects.exists() and not Delivery.objects.exists()
    assert list(AuditEvent.objects.order_by("pk").values_list("action", "source", "target")) == [
        ("channel.create", "dashboard", "mail"),
        ("channel.test", "dashboard", "mail"),
        ("channel.update", "dashboard", "mail"),
        ("channel.delete", "dashboard", "mail"),
    ]


def test_reasons_are_shown_beside_their_fields_and_nothing_is_saved(admin_a):
    answer = client_for(admin_a).post(
        "/teams/team-a/channels", form(target="nobody", events=[], jobs="Not A Job")
    )
    assert answer.status_code == 200
    page = answer.content.decode()
    assert 'id="err-target">Not a valid email address.' in page
    assert 'id="err-events">This field is required.' in page
    assert 'id="err-jobs">jobs[0]:' in page
    assert not Channel.objects.exists() and not AuditEvent.objects.exists()


def test_only_the_teams_admins_reach_its_channels(team_a, team_b, admin_a, receiver):
    theirs = make_channel(team_b, receiver.url, name="b")
    editor = make_user("erin-editor", team_a, "editor")
    assert client_for(editor).post("/teams/team-a/channels", form()).status_code == 403
    admin = client_for(admin_a)
    assert admin.get(f"/teams/team-b/channels/{theirs.pk}").status_code == 404
    assert admin.get(f"/teams/team-a/channels/{theirs.pk}").status_code == 404
    assert admin.post(f"/teams/team-a/channels/{theirs.pk}/test").status_code == 404
    assert admin.post(f"/teams/team-a/channels/{theirs.pk}/delete").status_code == 404
    assert admin.get(f"/teams/team-a/channels/{2**70}").status_code == 404
    assert admin.get("/teams/team-a/channels/1/test").status_code == 405
    assert Channel.objects.count() == 1 and receiver.requests == []


@pytest.mark.django_db(transaction=True)
def test_disabling_a_channel_deleted_meanwhile_says_so_and_leaves_it_deleted(admin_a, smtp):
    from apps.teams.models import Team
    from tests.conftest import sent_behind_a_change

    channel = make_channel(Team.objects.get(slug="team-a"), "oncall@example.com", kind="email")
    client = client_for(admin_a)
    answer = sent_behind_a_change(
        channel.pk,
        "DELETE FROM notify_channel WHERE id = %s",
        lambda: client.post(f"/teams/team-a/channels/{channel.pk}/enable", {"enabled": "0"}),
    )
    assert answer.status_code == 302 and answer["Location"] == "/teams/team-a#channels"
    assert (
        "The channel pager was deleted meanwhile." in client.get("/teams/team-a").content.decode()
    )
    assert not Channel.objects.exists()
    assert not AuditEvent.objects.filter(action="channel.update").exists()
