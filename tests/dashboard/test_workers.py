"""The workers page on the server: signed-in only, the user's teams only, a bad window ignored."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.runs import activity
from tests.dashboard.conftest import client_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_workers_page_shows_the_users_teams_only(viewer_a, team_a, team_b):
    assert Client().get("/workers")["Location"].startswith("/accounts/login/?next=/workers")
    activity.note_lease_activity(team_a.pk, ["billing"], "mine/1")
    activity.note_lease_activity(team_b.pk, ["search"], "theirs/2")
    page = client_for(viewer_a).get("/workers", {"minutes": "not-a-number"})
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-worker="mine/1"' in html and "theirs/2" not in html
    assert "last 15 min" in html  # the default window, for a window that is not one
