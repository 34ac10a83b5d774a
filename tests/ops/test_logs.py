"""Run events as JSON lines carrying the run id, job, attempt and fencing token."""

from __future__ import annotations

import json
import logging

import pytest

from apps.ops.logs import JsonFormatter
from apps.runs import store
from apps.runs.ids import public_run_id
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
