"""Lateness and missed-run alerts for definitions with a lateness SLO."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils.dateparse import parse_datetime

from apps.jobs.models import JobDefinition
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import Run
from tests.conftest import add_ready_runs, db_now, make_definition

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_run_started_ten_seconds_late_with_a_five_second_slo_is_flagged(api_a, team_a):
    definition = make_definition(
        team_a,
        "slo.report",
        queue="slo",
        lateness_slo_seconds=5,
        owner="#billing-oncall",
        runbook_url="https://runbooks.example.com/report",
    )
    add_ready_runs(definition, 1, age_seconds=10)
    on_time = make_definition(team_a, "slo.fast", queue="slo", lateness_slo_seconds=60)
    add_ready_runs(on_time, 1, age_seconds=1)
    before = api_a.get("/metrics").text
    api_a.lease(["slo"], 5)
    (alert,) = [a for a in api_a.get("/api/v1/alerts").json()["results"] if a["kind"] == "late"]
    assert (
        alert["job"] == "slo.report" and alert["lateBySeconds"] >= 10 and alert["sloSeconds"] == 5
    )
    assert alert["owner"] == "#billing-oncall" and alert["runbookUrl"].endswith("/report")
    assert alert["runId"] == Run.objects.get(definition=definition).run_id
    after = api_a.get("/metrics").text

    def late_count(text: str) -> float:
        lines = [
            line
            for line in text.splitlines()
            if line.startswith('scheduler_late_runs_total{queue="slo",team="team-a"}')
        ]
        return float(lines[0].split()[-1]) if lines else 0.0

    assert late_count(after) - late_count(before) == 1


def test_a_run_still_waiting_past_its_slo_is_late_before_it_starts(api_a, team_a):
    """No worker takes it (a paused queue, none running): late now, not once it starts."""
    definition = make_definition(team_a, "slo.stuck", queue="stuck", lateness_slo_seconds=5)
    (stuck,) = add_ready_runs(definition, 1, age_seconds=30)
    add_ready_runs(definition, 1, age_seconds=1, prefix="fresh")  # within its SLO: not late
    (alert,) = api_a.get("/api/v1/alerts").json()["results"]
    assert (alert["kind"], alert["runId"]) == ("late", public_run_id(stuck))
    assert alert["lateBySeconds"] >= 30
    assert "has not started" in alert["message"]


def test_lateness_counts_from_the_start_its_jitter_gave_the_run(api_a, team_a):
    """Due 100 s ago, jittered to start 10 s ago: within a 30 s SLO. Its words say so."""
    definition = make_definition(team_a, "slo.jittered", queue="jit", lateness_slo_seconds=30)
    (jittered,) = add_ready_runs(definition, 1, age_seconds=10)
    Run.objects.filter(pk=jittered).update(due_at=db_now() - timedelta(seconds=100))
    assert api_a.get("/api/v1/alerts").json()["results"] == []
    Run.objects.filter(pk=jittered).update(available_at=db_now() - timedelta(seconds=40))
    (alert,) = api_a.get("/api/v1/alerts").json()["results"]
    assert 40 <= alert["lateBySeconds"] < 100
    assert "has not started" in alert["message"] and "after it was due to start" in alert["message"]


def _hourly_job_without_runs(api, *, hours: int) -> None:
    """An hourly job with a 60 s SLO, made `hours` ago, whose cron times have had no run."""
    api.post(
        "/api/v1/jobs",
        {
            "name": "slo.hourly",
            "queue": "slo",
            "schedule": {"cron": "0 * * * *", "jitterSeconds": 0},
            "latenessSloSeconds": 60,
            "timeoutSeconds": 60,
        },
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE jobs_jobdefinition SET created_at = now() - make_interval(hours => %s),"
            " armed_at = now() - make_interval(hours => %s) WHERE name = 'slo.hourly'",
            [hours, hours],
        )


def test_a_cron_time_is_missed_only_once_its_jittered_start_is_past_its_slo(team_a):
    """A job whose jitter put its start past its SLO plus timeout was paged `job.missed` at
    every fire time, and recovered a little later, though each run started on time."""
    from apps.jobs import alerts
    from apps.jobs.schedule import jitter_offset

    name = next(f"slo.j{n}" for n in range(1000) if jitter_offset(f"slo.j{n}", 60) >= 40)
    offset = jitter_offset(name, 60)
    definition = make_definition(
        team_a, name, queue="slo", schedule={"cron": "* * * * *", "jitterSeconds": 60},
        lateness_slo_seconds=5, timeout_seconds=10,
    )  # fmt: skip
    fire = db_now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    made = fire - timedelta(seconds=1)
    JobDefinition.objects.filter(pk=definition.pk).update(created_at=made, armed_at=made)
    definition.refresh_from_db()
    since = fire - timedelta(hours=1)
    # Its run may start `offset` s after the cron time: not missed before that and its SLO
    # and timeout have passed, missed after.
    assert alerts._missed(definition, since, fire + timedelta(seconds=offset + 14)) == []
    (missed,) = alerts._missed(definition, since, fire + timedelta(seconds=offset + 15))
    assert (missed.kind, missed.due_at) == ("missed", fire)


def test_a_cron_time_without_any_run_is_missed(api_a, team_a):
    # The definition has existed for three hours and no scheduler ran: nothing was inserted.
    _hourly_job_without_runs(api_a, hours=3)
    missed = [a for a in api_a.get("/api/v1/alerts").json()["results"] if a["kind"] == "missed"]
    assert 2 <= len(missed) <= 3
    assert all(a["dueAt"].endswith(":00:00Z") for a in missed)
    # A successful run for one of those times clears it.
    definition = JobDefinition.objects.get()
    latest = max(a["dueAt"] for a in missed)

    def cron_run(due_at: str, state: str, **fields) -> Run:
        due = parse_datetime(due_at)
        return Run.objects.create(
            definition=definition,
            team=team_a,
            queue="slo",
            priority=1,
            shard=definition.shard,
            state=state,
            trigger="cron",
            due_at=due,
            available_at=due,
            max_attempts=3,
            idempotency_key=f"k@{due_at}",
            **fields,
        )

    cron_run(latest, "succeeded", finished_at=db_now() - timedelta(minutes=1))
    again = [
        a["dueAt"] for a in api_a.get("/api/v1/alerts").json()["results"] if a["kind"] == "missed"
    ]
    assert latest not in again and len(again) == len(missed) - 1
    assert all(a["runId"] is None and "(no run was made)" in a["message"] for a in missed)
    # A run made for a time that still waits is named: on call looks at it, not at the scheduler.
    run = cron_run(min(again), "ready")
    named = next(
        a for a in api_a.get("/api/v1/alerts").json()["results"] if a["dueAt"] == min(again)
    )
    assert (named["kind"], named["runId"]) == ("missed", public_run_id(run.pk))
    assert named["message"].endswith(f"({public_run_id(run.pk)} is ready).")
    # Stored as scheduled, its time passed: named as the run's page and the API name it (it
    # said "is scheduled" beside a run shown as ready).
    Run.objects.filter(pk=run.pk).update(state="scheduled")
    named = next(
        a for a in api_a.get("/api/v1/alerts").json()["results"] if a["dueAt"] == min(again)
    )
    assert named["message"].endswith(f"({public_run_id(run.pk)} is ready).")


@pytest.mark.parametrize("how", ["resume", "schedule"])
def test_no_time_before_a_resume_or_a_new_schedule_is_missed(api_a, team_a, how):
    """The missed times were rebuilt from the schedule as it is now, since the job was made:
    after a resume (the pause is not back-filled, by design) every paused time was reported
    missed and paged, and after a change of schedule, times of the new rule before it."""
    _hourly_job_without_runs(api_a, hours=3)
    if how == "resume":
        assert api_a.post("/api/v1/jobs/slo.hourly/pause").status_code == 200
        assert api_a.post("/api/v1/jobs/slo.hourly/resume").status_code == 200
    else:
        changed = {"schedule": {"cron": "30 * * * *", "jitterSeconds": 0}}
        assert api_a.patch("/api/v1/jobs/slo.hourly", changed).status_code == 200
    missed = [a for a in api_a.get("/api/v1/alerts").json()["results"] if a["kind"] == "missed"]
    assert missed == []


def test_definitions_without_an_slo_are_not_watched(api_a, team_a):
    definition = make_definition(team_a, "slo.none", queue="slo")
    add_ready_runs(definition, 1, age_seconds=100)
    api_a.lease(["slo"], 5)
    assert api_a.get("/api/v1/alerts").json()["results"] == []


def _alert_key(alert: dict) -> tuple:
    return (alert["kind"], alert["job"], alert["runId"], alert["dueAt"])


def test_alerts_are_paged_newest_first_each_once_ties_included(api_a, team_a):
    """Late runs of two jobs due at the same instant and missed cron times: walking the pages
    by their `next` link gives the one long page's alerts in its order, each once."""
    for name in ("slo.a", "slo.b"):
        add_ready_runs(
            make_definition(team_a, name, queue="slo", lateness_slo_seconds=5), 6, age_seconds=60
        )
    with connection.cursor() as cursor:
        # Ties within a job and across jobs: only the run's id and the job's name order them.
        cursor.execute(
            "UPDATE runs_run SET due_at = date_trunc('second', now()) - interval '1 minute'"
        )
    _hourly_job_without_runs(api_a, hours=5)
    whole = api_a.get("/api/v1/alerts?limit=500").json()
    assert whole["next"] is None and whole["total"] == len(whole["results"]) >= 16
    assert {a["kind"] for a in whole["results"]} == {"late", "missed"}

    walked, url, pages = [], "/api/v1/alerts?limit=4", 0
    while url:
        page = api_a.get(url).json()
        assert len(page["results"]) <= 4 and page["total"] == whole["total"]
        walked += page["results"]
        url, pages = page["next"], pages + 1
    assert pages == -(-whole["total"] // 4)
    assert [_alert_key(a) for a in walked] == [_alert_key(a) for a in whole["results"]]
    assert len(set(map(_alert_key, walked))) == len(walked)
    due = [a["dueAt"] for a in walked]
    assert due == sorted(due, reverse=True)


def test_a_bad_page_of_alerts_is_a_400(api_a, team_a):
    for query, field in (
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("cursor=nope", "cursor"),
        ("cursor=2026-01-01T00:00:00Z|late|x|slo.a", "cursor"),
        ("cursor=2026-01-01T00:00:00Z|gone|1|slo.a", "cursor"),
    ):
        response = api_a.get(f"/api/v1/alerts?{query}")
        assert response.status_code == 400, query
        assert field in response.json()["errors"], query


def test_a_page_of_alerts_reads_a_page_of_runs_not_the_whole_backlog(team_a):
    """40 000 runs of one watched job waiting made a list of 41 000 alerts (9 MB), read whole
    by each look of the API, the dashboard and the notifier."""
    from django.test.utils import CaptureQueriesContext

    from apps.jobs import alerts

    definition = make_definition(team_a, "slo.backlog", queue="slo", lateness_slo_seconds=5)
    add_ready_runs(definition, 300, age_seconds=60)
    with CaptureQueriesContext(connection) as captured:
        found = alerts.alerts_for(team_a, db_now(), limit=3)
    assert len(found.alerts) == 3 and found.total == 300
    reads = [
        q["sql"] for q in captured if '"runs_run"."due_at"' in q["sql"] and "COUNT(" not in q["sql"]
    ]
    assert reads and all(sql.rstrip().endswith("LIMIT 3") for sql in reads)
    newest = alerts.newest_by_job(team_a, db_now())
    assert [a.run_id for a in newest] == [found.alerts[0].run_id]


def test_an_alerts_cursor_keeps_the_due_time_to_the_microsecond():
    """A run's due time has microseconds (a page's answers show milliseconds): a cursor cut to
    them would skip or repeat the runs due within that millisecond."""
    from datetime import UTC, datetime

    from apps.jobs.alerts import Position

    here = Position(datetime(2026, 3, 29, 1, 0, 0, 123456, tzinfo=UTC), "a.b|c", "late", 5)
    assert Position.from_cursor(here.as_cursor()) == here
    assert Position.from_cursor(here.as_cursor().replace(".123456", ".123")) != here


def test_a_backfilled_run_is_never_late(api_a, team_a):
    """A backfill asks for past times on purpose: each of its runs was listed late (and paged
    as job.late), its lateness counted from its past due time, waiting or started."""
    assert api_a.post(
        "/api/v1/jobs",
        {"name": "slo.backfilled", "queue": "filled", "latenessSloSeconds": 5,
         "schedule": {"cron": "*/10 * * * *", "jitterSeconds": 0}},
    ).status_code == 201  # fmt: skip
    now = db_now()
    window = {"from": format_utc(now - timedelta(hours=2)), "to": format_utc(now), "confirm": True}
    made = api_a.post("/api/v1/jobs/slo.backfilled/backfill", window)
    assert made.status_code == 200 and made.json()["created"] >= 10, made.text
    api_a.lease(["filled"], 3)  # some started, the rest waiting
    late = [a for a in api_a.get("/api/v1/alerts").json()["results"] if a["kind"] == "late"]
    assert late == []
