"""Stack traces: the SDK's worker and the Celery bridge's task report `error.stack` when a
handler raises, cut to 64 KB, and it is stored with the run's last error and its attempt."""

from __future__ import annotations

from types import SimpleNamespace

import celery
import httpx
import pytest
from cronlease_client import Context, NonRetryable
from cronlease_client.celery import tasks
from cronlease_client.celery.tasks import TaskSpec, execute
from cronlease_client.reporting import MAX_STACK, Report, describe_failure

from apps.runs.ids import public_run_id
from apps.runs.models import Attempt, Run
from tests.client.conftest import runs_when, wait_for
from tests.conftest import Api, add_ready_runs, make_definition

LIVE = pytest.mark.django_db(transaction=True)  # a live server answers the SDK


def look_up(customer: str) -> None:
    raise KeyError(f"customer {customer}")


def charge(ctx: Context) -> None:
    try:
        look_up("acme")
    except KeyError as exc:
        raise NonRetryable("no such customer") from exc


@LIVE
def test_a_raising_handlers_stack_reaches_the_run_and_its_attempt(
    team_a, make_worker, live_server, token_a
):
    definition = make_definition(team_a, "billing.charge", queue="stacks", retry_max_attempts=3)
    (pk,) = add_ready_runs(definition, 1)
    make_worker(["stacks"], handlers={"billing.charge": charge}).start()

    (run,) = wait_for(runs_when([pk], "dead"), what="the run dead at once (NonRetryable)")
    stack = run.last_error["stack"]
    # The whole chain: the lookup that raised, then the handler's deliberate NonRetryable.
    assert stack.startswith("Traceback (most recent call last):")
    assert "in look_up" in stack and "KeyError: 'customer acme'" in stack
    assert "The above exception was the direct cause" in stack
    assert stack.rstrip().endswith("NonRetryable: no such customer")
    assert (run.last_error["type"], run.last_error["message"]) == ("KeyError", "no such customer")
    assert Attempt.objects.get(run_id=pk).error_stack == stack

    answer = httpx.get(
        f"{live_server.url}/api/v1/runs/{public_run_id(pk)}",
        headers={"Authorization": f"Bearer {token_a}"},
    ).json()
    assert answer["lastError"]["stack"] == stack
    assert answer["attempts"][0]["error"]["stack"] == stack


def test_a_stack_past_64_kb_is_cut_by_the_sdk_keeping_its_end():
    try:
        raise ValueError("x" * (2 * MAX_STACK))
    except ValueError as exc:
        report = describe_failure(exc)
    sent = report.item("run_1", 7)["error"]["stack"]
    assert len(sent) == MAX_STACK and sent.endswith("x\n")
    assert sent.startswith("[") and "characters cut]\n" in sent.split("\n", 1)[0] + "\n"
    assert "stack" not in Report("failed", message="no stack").item("run_1", 7)["error"]


@LIVE
def test_a_celery_tasks_failure_reports_its_stack(team_a, live_server, worker_token_a):
    definition = make_definition(team_a, "reports.upstream", queue="celery-stacks")
    (pk,) = add_ready_runs(definition, 1)
    app = celery.Celery("stack-test", set_as_current=False)
    app.conf.cronlease_url = live_server.url
    app.conf.cronlease_token = worker_token_a

    def fetch_report(ctx: Context) -> None:
        raise ConnectionError(f"upstream unavailable (attempt {ctx.attempt})")

    spec = TaskSpec("reports.upstream", fetch_report, task=None, app=app)
    task = SimpleNamespace(app=app, request=SimpleNamespace(hostname="celery@test"))
    api = Api(live_server.url, worker_token_a)
    (lease,) = api.lease(["celery-stacks"], 1)
    api.http.close()

    summary = execute(task, spec, lease, {})  # the Celery task's body, in this process
    # Its connection, kept for the thread's next task: closed, so no server thread stays on.
    tasks._local.transport[1].close()

    assert summary["outcome"] == "failed"
    run = Run.objects.get(pk=pk)
    stack = run.last_error["stack"]
    assert "in fetch_report" in stack
    assert stack.rstrip().endswith("ConnectionError: upstream unavailable (attempt 1)")
    assert Attempt.objects.get(run_id=pk).error_stack == stack
