"""The audit page's order: newest first by the events' time, paged without gaps or repeats."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.audit.models import AuditEvent
from apps.dashboard import queries
from tests.conftest import db_now

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_event_relayed_late_is_listed_at_its_time_and_paging_keeps_every_event(team_a):
    """An event kept with its rows in a shard database gets its id when it is relayed: listed
    by id, one relayed a minute late stood above the events written meanwhile."""
    now = db_now()
    # (target, seconds ago), in the order their rows are inserted (their ids).
    made = [("a", 50), ("b", 40), ("c", 30), ("late", 45), ("d", 20), ("e", 20)]
    for target, ago in made:
        event = AuditEvent.objects.create(
            team=team_a, actor="t", source="cli", action="job.update", target_type="job",
            target=target,
        )  # fmt: skip
        AuditEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(seconds=ago))
    flt = queries.AuditFilter(team_ids=[team_a.pk])
    seen: list[str] = []
    cursor = None
    while True:
        page, cursor = queries.audit_page(flt, before=cursor, limit=2)
        seen += [event.target for event in page]
        if cursor is None:
            break
    assert seen == ["e", "d", "c", "b", "late", "a"]


def test_an_event_about_many_runs_links_to_none(operator_a, team_a):
    """A bulk enqueue's event names "3 runs": linked as a run, it led to a 404."""
    from tests.dashboard.conftest import client_for

    for target in ("3 runs", "run_1ZE10E"):
        AuditEvent.objects.create(
            team=team_a, actor="t", source="cli", action="run.create", target_type="run",
            target=target,
        )  # fmt: skip
    page = client_for(operator_a).get("/audit").content.decode()
    assert "3 runs" in page and "/runs/3%20runs" not in page
    assert 'href="/runs/run_1ZE10E"' in page
