"""Triage on the dashboard, server side: failures and the DLQ grouped by error, actions on
everything a filter or a group selects (the count first, then one statement per database and
one audit event), the run-id search, and what a run's page says about its errors."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from html import escape

import pytest
from django.db.models import F
from django.test import Client

from apps.audit.models import AuditEvent
from apps.runs import fingerprints, store
from apps.runs.models import Run
from apps.teams.models import Membership
from tests.conftest import add_ready_runs, make_definition
from tests.dashboard.conftest import XSS, client_for, failed_runs
from tests.triage_runs import insert_failed, person

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(team_a):
    return person("oscar-operator", team_a, "operator")


@pytest.fixture
def viewer(team_a):
    return person("vera-viewer", team_a, "viewer")


def test_failures_grouped_by_error_show_counts_times_jobs_and_act_per_group(operator, team_a):
    charge = make_definition(team_a, "billing.charge", queue="billing")
    refund = make_definition(team_a, "billing.refund", queue="billing")
    keyed = insert_failed(charge, 25, message=f"{XSS} 'user %s'")
    insert_failed(refund, 5, prefix="refund-", message=f"{XSS} 'user %s'")
    insert_failed(charge, 3, state="retrying", error_type="TimeoutError", message="after %s s")
    client = client_for(operator)

    body = client.get("/failures?view=groups").content.decode()
    assert "33 runs in 2 error groups" in body
    key = fingerprints.to_hex(keyed)
    row = body.split(f'id="group-{key}"')[1].split("</tr>")[0]
    # The group's words, escaped, with its placeholders (the script's 1 is a number too).
    assert escape("KeyError: <script>alert(<n>)</script> '<str>'") in row
    assert XSS not in body
    assert ">30</a>" in row and "billing.charge</a>, <a" in row and "billing.refund" in row
    assert row.count("<time") == 2  # first and last seen
    assert f'name="group" value="{key}"' in row
    # Every run of the group is dead: retried, never cancelled (the confirmation would say 0).
    assert "Retry 30…" in row and "Cancel" not in row
    timeouts = body.split('id="group-')[2].split("</tr>")[0]
    assert "Retry 3…" in timeouts and "Cancel 3…" in timeouts
    # The group's count links to its runs: the list of that group alone.
    runs = client.get(f"/failures?group={key}").content.decode()
    assert runs.count('id="run-row-') == 30
    assert 'id="group-filter"' in runs
    assert client.get("/failures?group=nothex").status_code == 200  # a form error, not a 500


def test_a_groups_buttons_count_the_runs_the_user_may_act_on(operator, team_a, team_b):
    # Operator in team A, viewer in team B: the group holds both teams' runs, and its button
    # says what the confirmation will act on.
    Membership.objects.create(user=operator, team=team_b, role="viewer")
    keyed = insert_failed(make_definition(team_a, "billing.charge", queue="billing"), 10)
    insert_failed(make_definition(team_b, "other.charge", queue="billing"), 3, prefix="b-")
    client = client_for(operator)
    key = fingerprints.to_hex(keyed)

    body = client.get("/dlq?view=groups").content.decode()
    row = body.split(f'id="group-{key}"')[1].split("</tr>")[0]
    assert ">13</a>" in row
    assert "Requeue 10…" in row and "of 13: the others are in teams you only view" in row
    ask = {"mode": "dlq", "action": "requeue", "group": key, "next": "/dlq"}
    confirm = client.post("/runs/matching", ask, HTTP_HX_REQUEST="true").content.decode()
    assert "Requeue 10 runs?" in confirm
    # A group only of runs the user views offers no action.
    only_b = client.get("/dlq?view=groups&team=team-b").content.decode()
    row_b = only_b.split(f'id="group-{key}"')[1].split("</tr>")[0]
    assert ">3</a>" in row_b and "Requeue" not in row_b


def test_a_groups_buttons_count_the_runs_each_action_accepts(operator, team_a):
    job = make_definition(team_a, "billing.charge", queue="billing")
    keyed = insert_failed(job, 6)
    insert_failed(job, 4, state="retrying", prefix="r-")
    client = client_for(operator)
    key = fingerprints.to_hex(keyed)

    body = client.get("/failures?view=groups").content.decode()
    row = body.split(f'id="group-{key}"')[1].split("</tr>")[0]
    assert ">10</a>" in row and "Retry 10…" in row and "Cancel 4…" in row
    ask = {"mode": "failures", "action": "cancel", "group": key, "next": "/failures"}
    confirm = client.post("/runs/matching", ask, HTTP_HX_REQUEST="true").content.decode()
    assert "Cancel 4 runs?" in confirm


def test_a_group_action_shows_the_count_then_changes_it_in_one_audited_step(operator, team_a):
    job = make_definition(team_a, "billing.charge", queue="billing")
    keyed = insert_failed(job, 40)
    insert_failed(job, 7, error_type="TimeoutError", message="after %s s", prefix="t-")
    client = client_for(operator)
    ask = {"mode": "dlq", "action": "requeue", "group": fingerprints.to_hex(keyed), "next": "/dlq"}

    confirm = client.post("/runs/matching", ask, HTTP_HX_REQUEST="true").content.decode()
    assert "Requeue 40 runs?" in confirm
    # The group by its error, as the list shows it, not by its key.
    described = confirm.split('id="confirm-filter"')[1].split("</dl>")[0]
    words = escape("KeyError: '<str>'")
    assert f'error group</dt><dd><span class="mono">{words}</span>' in described
    assert fingerprints.to_hex(keyed) not in described
    assert Run.objects.filter(state="dead").count() == 47  # nothing changed yet

    done = client.post("/runs/matching", {**ask, "confirm": "yes"})
    assert done.status_code == 302 and done["Location"] == "/dlq"
    assert Run.objects.filter(state="ready").count() == 40
    assert Run.objects.filter(state="dead").count() == 7
    (event,) = AuditEvent.objects.filter(action="dlq.requeue")
    assert (event.source, event.actor, event.after["count"]) == (
        "dashboard",
        operator.username,
        40,
    )


def test_everything_matching_a_filter_is_counted_and_acted_on_with_the_window_it_meant(
    operator, team_a
):
    job = make_definition(team_a, "billing.charge", queue="billing")
    other = make_definition(team_a, "billing.refund", queue="billing")
    insert_failed(job, 12)
    insert_failed(other, 3, prefix="other-")
    client = client_for(operator)
    page = client.get("/dlq?job=billing.charge&range=24h").content.decode()
    assert 'id="matching-form"' in page and "Requeue all matching…" in page
    assert '<input type="hidden" name="range" value="24h">' in page

    ask = {"mode": "dlq", "action": "discard", "job": "billing.charge", "range": "24h"}
    confirm = client.post("/runs/matching", ask).content.decode()
    assert "Discard 12 runs?" in confirm
    # The relative range travels on as the absolute window it meant at the count.
    assert 'name="due_from" value="' in confirm and 'name="range"' not in confirm
    # Shown as a time the page writes in the reader's zone (it was the UTC text of the filter).
    described = confirm.split('id="confirm-filter"')[1].split("</dl>")[0]
    assert re.search(r'due from</dt><dd><time datetime="[^"]+" [^>]*data-when=', described)
    client.post("/runs/matching", {**ask, "confirm": "yes"})
    # The message says the window as times the page writes in the reader's zone.
    said = client.get("/dlq").content.decode().split('id="messages"')[1].split("</ul>")[0]
    assert "Discarded 12 runs matching job billing.charge; due from <time datetime=" in said
    assert Run.objects.filter(definition=job, state="cancelled").count() == 12
    assert Run.objects.filter(definition=other, state="dead").count() == 3
    (event,) = AuditEvent.objects.filter(action="dlq.discard")
    assert event.before["filter"]["job"] == "billing.charge"
    assert "dueFrom" in event.before["filter"]


def test_the_due_window_is_read_in_the_readers_zone_for_the_list_and_for_the_action(
    operator, team_a
):
    """The page shows local times, and the page's script sends the reader's zone with the
    filter (`tz`): 10:00 typed in New York is 15:00 UTC in January (before: 10:00 UTC)."""
    job = make_definition(team_a, "billing.charge", queue="billing")
    early, late = failed_runs(job, 2)
    Run.objects.filter(pk=early.pk).update(due_at=datetime(2026, 1, 10, 11, 0, tzinfo=UTC))
    Run.objects.filter(pk=late.pk).update(due_at=datetime(2026, 1, 10, 16, 0, tzinfo=UTC))
    client = client_for(operator)
    window = "due_from=2026-01-10T10:00&due_to=2026-01-10T12:00"
    page = client.get(f"/dlq?{window}&tz=America/New_York").content.decode()
    assert late.run_id in page and early.run_id not in page
    assert "Due from (<span data-zone-name>America/New_York</span>)" in page
    assert '<input type="hidden" name="tz" value="America/New_York">' in page  # carried on
    in_utc = client.get(f"/dlq?{window}").content.decode()  # no script: UTC, as it says
    assert early.run_id in in_utc and late.run_id not in in_utc and ">UTC</span>" in in_utc

    ask = {"mode": "dlq", "action": "discard", "due_from": "2026-01-10T10:00",
           "tz": "America/New_York"}  # fmt: skip
    confirm = client.post("/runs/matching", ask).content.decode()
    assert "Discard 1 run?" in confirm
    assert 'name="due_from" value="2026-01-10T15:00:00"' in confirm  # as UTC from here on
    client.post("/runs/matching", {**ask, "confirm": "yes"})
    assert Run.objects.get(pk=late.pk).state == "cancelled"
    assert Run.objects.get(pk=early.pk).state == "dead"

    refused = client.get("/dlq?due_from=2026-01-10T10:00&tz=Mars/Olympus")
    assert "Not a time zone" in refused.content.decode()
    skipped = client.get("/dlq?due_from=2026-03-08T02:30&tz=America/New_York")  # DST's gap
    assert "may not exist" in skipped.content.decode()
    # Times at the calendar's ends that leave it once read in UTC (they were a 500).
    for path in ("/runs?due_from=0001-01-01T00:00&tz=Asia/Tokyo",
                 "/failures?due_to=9999-12-31T23:59&tz=America/New_York",
                 "/failures?view=groups&due_from=0001-01-01T00:00&tz=Asia/Tokyo"):  # fmt: skip
        answer = client.get(path)
        assert answer.status_code == 200, path
        assert "Outside the years 1 to 9999 once read in UTC." in answer.content.decode(), path


def test_a_confirmed_action_leaves_out_the_runs_that_failed_after_the_count(operator, team_a):
    job = make_definition(team_a, "billing.charge", queue="billing")
    insert_failed(job, 12)
    client = client_for(operator)
    ask = {"mode": "dlq", "action": "requeue", "queue": "billing"}
    confirm = client.post("/runs/matching", ask).content.decode()
    assert "Requeue 12 runs?" in confirm and 'name="failed_by" value="' in confirm
    failed_by = confirm.split('name="failed_by" value="')[1].split('"')[0]
    # Five more die while the person reads the confirmation.
    insert_failed(job, 5, prefix="late-")
    Run.objects.filter(idempotency_key__startswith="late-").update(
        failed_at=F("failed_at") + timedelta(minutes=1)
    )
    client.post("/runs/matching", {**ask, "failed_by": failed_by, "confirm": "yes"})
    assert Run.objects.filter(state="ready").count() == 12
    assert Run.objects.filter(state="dead", idempotency_key__startswith="late-").count() == 5
    (event,) = AuditEvent.objects.filter(action="dlq.requeue")
    assert event.after["count"] == 12
    # The same instant; the audit writes it without a zero fraction (".000Z" at a whole second).
    recorded = datetime.fromisoformat(event.before["filter"]["failedBy"])
    assert recorded == datetime.fromisoformat(failed_by)


def test_acting_on_a_filter_needs_the_operator_role_and_a_list_that_offers_it(
    viewer, operator, team_a, team_b
):
    job = make_definition(team_a, "billing.charge", queue="billing")
    theirs = make_definition(team_b, "search.reindex", queue="search")
    insert_failed(job, 2)
    insert_failed(theirs, 3)
    ask = {"mode": "dlq", "action": "requeue", "confirm": "yes"}
    assert Client().post("/runs/matching", ask)["Location"].startswith("/accounts/login/")
    assert client_for(viewer).post("/runs/matching", ask).status_code == 403
    assert "Everything matching" not in client_for(viewer).get("/dlq").content.decode()
    client = client_for(operator)
    assert client.post("/runs/matching", {**ask, "mode": "runs"}).status_code == 404
    client.post("/runs/matching", {**ask, "action": "cancel"})  # not a DLQ action
    assert set(Run.objects.values_list("state", flat=True)) == {"dead"}
    assert not AuditEvent.objects.exists()

    # A viewer of team B too: "all teams" means the teams where they may act, and says so.
    Membership.objects.create(user=operator, team=team_b, role="viewer")
    assert client.post("/runs/matching", {**ask, "team": "team-b"}).status_code == 403
    confirm = client.post("/runs/matching", {"mode": "dlq", "action": "requeue"}).content.decode()
    assert "Requeue 2 runs?" in confirm
    assert 'teams</dt><dd><span class="mono">team-a</span></dd>' in confirm
    client.post("/runs/matching", ask)
    assert Run.objects.filter(state="ready").count() == 2
    assert Run.objects.filter(definition=theirs, state="dead").count() == 3


def test_the_run_id_search_goes_to_the_run_or_says_there_is_none(viewer, team_a, team_b):
    mine = make_definition(team_a, "billing.charge", queue="billing")
    theirs = make_definition(team_b, "search.reindex", queue="search")
    (pk,) = add_ready_runs(mine, 1)
    (other,) = add_ready_runs(theirs, 1)
    run_id = Run.objects.get(pk=pk).run_id
    client = client_for(viewer)
    assert 'name="run"' in client.get("/").content.decode()  # in the header of every page

    found = client.get("/runs", {"run": f"  {run_id.lower()} "})
    assert found.status_code == 302 and found["Location"] == f"/runs/{run_id}"
    for wanted in (Run.objects.get(pk=other).run_id, "run_ZZZZZZZZ", f"{XSS}"):
        page = client.get("/runs", {"run": wanted})
        assert page.status_code == 200
        assert f"No such run: {escape(wanted)}" in page.content.decode()


def test_a_dead_runs_page_offers_one_way_back_and_folds_its_stack(operator, team_a):
    job = make_definition(team_a, "billing.charge", queue="billing", retry_max_attempts=1)
    add_ready_runs(job, 1)
    (lease,) = store.claim(queues=["billing"], max_runs=1, worker_id="w/1", lease_seconds=60)
    stack = f'Traceback (most recent call last):\n  File "charge.py", line 9\n{XSS}'
    store.fail(
        [(lease.id, lease.fencing_token, {"type": "E", "message": "boom", "stack": stack}, True)],
        team_ids=[team_a.pk],
    )
    run = Run.objects.get(pk=lease.id)
    body = client_for(operator).get(f"/runs/{run.run_id}").content.decode()
    buttons = [b.split(">")[1] for b in body.split('<button class="btn')[1:]]
    assert "Requeue</button" in buttons and "Discard</button" in buttons
    assert "Retry</button" not in buttons
    assert '<details class="stack" id="last-error-stack">' in body
    assert escape(stack) in body and XSS not in body
    assert "Stack trace of attempt 1" in body


def test_a_succeeded_run_shows_its_earlier_errors_as_history_only(viewer, team_a):
    job = make_definition(team_a, "billing.charge", queue="billing", retry_max_attempts=2)
    (run,) = failed_runs(job, retryable=True, message="card declined")
    Run.objects.filter(pk=run.pk).update(available_at=run.created_at)
    (lease,) = store.claim(queues=["billing"], max_runs=1, worker_id="w/2", lease_seconds=60)
    store.complete([(lease.id, lease.fencing_token, None)], team_ids=[team_a.pk])
    client = client_for(viewer)
    body = client.get(f"/runs/{run.run_id}").content.decode()
    assert 'id="last-error"' not in body and 'id="earlier-error"' in body
    assert "RuntimeError: card declined" in body  # in attempt 1, as history
    listed = client.get("/runs?state=succeeded").content.decode()
    row = listed.split(f'id="run-row-{run.pk}"')[1].split("</tr>")[0]
    assert "error-text" not in row and "card declined" in row


def test_an_empty_filtered_list_says_its_filters_match_nothing(operator, team_a):
    """ "The dead-letter queue is empty." was shown under a filter matching none of the dead runs
    that waited: an on-call engineer took the DLQ for clear."""
    job = make_definition(team_a, "billing.charge", queue="billing")
    failed_runs(job, 2, retryable=False)
    client = client_for(operator)
    for page in ("/dlq", "/failures"):
        filtered = client.get(f"{page}?error=NoSuchError").content.decode()
        assert "No runs match these filters." in filtered, page
        assert "is empty" not in filtered and "Nothing is failing" not in filtered
    grouped = client.get("/dlq?view=groups&job=nobody.here").content.decode()
    assert "No failures match these filters." in grouped
