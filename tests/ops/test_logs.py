"""Run events as JSON lines carrying the run id, attempt, fencing token and (but for a
completion's) the job."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

import pytest

from apps.ops.logs import JsonFormatter
from apps.runs import store
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import Run
from tests.conftest import add_ready_runs, make_definition

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_run_can_be_followed_by_its_id(team_a, caplog):
    definition = make_definition(team_a, "log.job", queue="lq")
    add_ready_runs(definition, 1)
    with caplog.at_level(logging.INFO, logger="scheduler.runs"):
        (lease,) = store.claim(queues=["lq"], max_runs=1, worker_id="host/1", lease_seconds=60)
        store.complete([(lease.id, lease.fencing_token, None)], team_ids=[team_a.pk])
        store.complete([(lease.id, lease.fencing_token, None)], team_ids=[team_a.pk])
    lines = [
        json.loads(JsonFormatter().format(record))
        for record in caplog.records
        if record.name == "scheduler.runs"
    ]
    run_id = public_run_id(lease.id)
    assert [line["msg"] for line in lines][:2] == ["run leased", "run succeeded"]
    assert all(line["run_id"] == run_id for line in lines)
    assert lines[0]["job"] == "log.job" and lines[0]["attempt"] == 1
    assert lines[0]["fencing_token"] == lease.fencing_token and lines[0]["worker_id"] == "host/1"
    assert lines[2]["msg"].startswith("refused (409)")
    assert lines[1]["attempt"] == 1  # before: a completion's line had no attempt


def test_failed_and_reaped_runs_are_logged_with_their_job_and_attempt(team_a, caplog):
    definition = make_definition(team_a, "log.fails", queue="lq", retry_max_attempts=3)
    add_ready_runs(definition, 2)
    with caplog.at_level(logging.INFO, logger="scheduler.runs"):
        first, second = store.claim(queues=["lq"], max_runs=2, worker_id="w", lease_seconds=60)
        store.fail(
            [(first.id, first.fencing_token, {"message": "boom"}, True)], team_ids=[team_a.pk]
        )
        expired = datetime(2000, 1, 1, tzinfo=UTC)
        Run.objects.filter(pk=second.id).update(lease_expires_at=expired)
        store.reap()
    lines = {
        line["run_id"]: line
        for line in (json.loads(JsonFormatter().format(r)) for r in caplog.records)
        if line["msg"] != "run leased"
    }
    failed, reaped = lines[public_run_id(first.id)], lines[public_run_id(second.id)]
    assert (failed["msg"], failed["job"], failed["attempt"]) == ("run retrying", "log.fails", 1)
    assert reaped["msg"] == "run reaped: lease_expired"
    assert (reaped["job"], reaped["attempt"]) == ("log.fails", 1)


def test_a_lines_time_is_written_as_every_instant_is_to_the_millisecond():
    formatter = JsonFormatter()
    for created in (1_764_756_941.837, 1_764_756_941.0, 1_764_756_942.9995, 1_764_756_941.5):
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", (), None)
        record.created = created
        written = json.loads(formatter.format(record))["ts"]
        instant = datetime.fromtimestamp(created, UTC)
        expected = format_utc(instant.replace(microsecond=instant.microsecond // 1000 * 1000))
        if "." not in expected:
            expected = expected[:-1] + ".000Z"
        assert written == expected


def test_a_field_json_cannot_hold_is_written_as_text_and_a_huge_integer_whole():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m %s", ("arg",), None)
    record.run_id = "run_1"
    record.count = 2**70  # past orjson's 64 bits
    record.state = object()
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "m arg" and line["run_id"] == "run_1"
    assert line["count"] == 2**70
    assert line["state"].startswith("<object object")
