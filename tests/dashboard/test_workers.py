"""The workers page on the server: signed-in only, the user's teams only, a bad window ignored."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client

from apps.runs import activity
from apps.runs import workers as seen_workers
from apps.runs.models import Attempt, Run
from tests.conftest import add_ready_runs, claim, db_now, make_definition
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


def test_the_leases_about_to_expire_are_the_soonest_in_their_last_third(team_a, team_b):
    job = make_definition(team_a, "expiring.job", queue="expiring")
    add_ready_runs(job, 6)
    leases = claim(queues=["expiring"], max_runs=6, worker_id="pod/1", team_ids=[team_a.pk])
    # Seconds left of a 60-s lease: 50 and 30 are not in its last third (20 s).
    left = dict(zip((lease.id for lease in leases), (50, 30, 15, -3, 5, 19), strict=True))
    for pk, seconds in left.items():
        Run.objects.filter(pk=pk).update(
            lease_expires_at=db_now() + timedelta(seconds=seconds), lease_seconds=60
        )
    found = seen_workers.seen([team_a.pk, team_b.pk], 15, expiring=3)
    assert [lease.pk for lease in found.expiring] == sorted(
        (pk for pk, seconds in left.items() if seconds < 20), key=left.get
    )[:3]
    assert found.expiring[0].expired and not found.expiring[1].expired
    (worker,) = found.workers
    assert (worker.worker_id, worker.in_flight) == ("pod/1", 6)
    newest = Attempt.objects.get(run_id=max(leases, key=lambda lease: lease.fencing_token).id)
    assert worker.last_lease_at == newest.leased_at
