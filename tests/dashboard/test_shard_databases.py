"""The dashboard with shards on servers of their own: every page reads every shard database, and
one that is down is named in a banner while the page shows the rest (a page about one run or
job of it says so instead)."""

from __future__ import annotations

import pytest

from apps.runs import shards
from tests.conftest import Layout, stored_run
from tests.dashboard.conftest import client_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.physical,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]

PAGES = ["/", "/failures", "/runs", "/dlq", "/jobs", "/queues", "/alerts"]


def test_every_page_shows_each_database_and_names_one_that_is_down(
    layout: Layout, team_a, operator_a
):
    jobs = {alias: layout.job_on(alias, team_a, "page") for alias in shards.databases()}
    dead = {alias: layout.dead_runs(job, 1, "d")[0] for alias, job in jobs.items()}
    client = client_for(operator_a)

    for page in PAGES:
        answer = client.get(page)
        assert answer.status_code == 200, page
        assert b'id="unavailable-shards"' not in answer.content, page
    listed = client.get("/dlq").content.decode()
    jobs_page = client.get("/jobs").content.decode()
    for alias, job in jobs.items():
        assert dead[alias].run_id in listed
        assert job.name in jobs_page
    stats = client.get("/").context["stats"]
    assert stats.dlq == len(jobs)  # every database's dead runs

    down = layout.aliases[1]
    span = shards.span(down)
    with layout.down(1):
        shown = {page: client.get(page) for page in PAGES}
        run_page = client.get(f"/runs/{dead[down].run_id}")
        job_page = client.get(f"/jobs/{jobs[down].name}")
        other_run = client.get(f"/runs/{dead[layout.aliases[0]].run_id}")
        # An action is refused whole, and the page says so, not "this page cannot be shown".
        pause = client.post(f"/jobs/{jobs[down].name}/pause")
        requeue = client.post(
            "/runs/bulk",
            {"action": "requeue", "ids": [run.run_id for run in dead.values()], "confirm": "yes"},
        )
    for page, answer in shown.items():
        assert answer.status_code == 200, page
        text = answer.content.decode()
        assert f"Shards {span} are unavailable" in text, page
    dlq = shown["/dlq"].content.decode()
    assert dead[down].run_id not in dlq
    assert all(run.run_id in dlq for alias, run in dead.items() if alias != down)
    assert jobs[down].name not in shown["/jobs"].content.decode()
    for answer in (run_page, job_page):
        assert (answer.status_code, answer["Retry-After"]) == (503, "1")
        assert f"Shards {span} are unavailable" in answer.content.decode()
    assert other_run.status_code == 200
    for answer in (pause, requeue):
        text = answer.content.decode()
        assert answer.status_code == 503 and f"Shards {span} are unavailable" in text
        assert "this action was refused and nothing was changed" in text
        assert "this page cannot be shown" not in text
    assert all(stored_run(run.pk).state == "dead" for run in dead.values())


def test_a_job_saved_on_a_database_that_is_down_keeps_the_form_and_says_why(
    layout: Layout, team_a, editor_a
):
    from apps.jobs.models import JobDefinition
    from apps.jobs.schedule import shard_for
    from tests.dashboard.test_job_form import FORM

    down = layout.aliases[1]
    name = next(
        f"down.job{n}"
        for n in range(1000)
        if shards.alias_of_shard(shard_for(f"down.job{n}")) == down
    )
    client = client_for(editor_a)
    with layout.down(1):
        answer = client.post("/jobs/new", {**FORM, "name": name, "owner": "kept@example.com"})
    assert answer.status_code == 200  # the form again, not the page of a job
    text = answer.content.decode()
    assert f"Not saved: shards {shards.span(down)} are unavailable" in text
    assert 'value="kept@example.com"' in text
    with shards.using(down):
        assert not JobDefinition.objects.filter(name=name).exists()


def test_an_action_on_everything_matching_that_fails_on_one_database_says_what_it_changed(
    layout: Layout, team_a, operator_a
):
    """Its databases commit one after the other (not two-phase): when the second fails at its
    commit after the first committed, the page said "database failed" (a 503) over runs it had
    changed. It says how many were changed and which shards were not."""
    from django.db.models import Q

    from apps.runs.models import Run
    from tests.api.test_shard_databases_manage import _refused_at_commit

    failing, committing = layout.aliases[0], layout.aliases[-1]
    kept = layout.dead_runs(layout.job_on(committing, team_a, "kept"), 2, "k")
    lost = layout.dead_runs(layout.job_on(failing, team_a, "lost"), 3, "l")
    client = client_for(operator_a)
    ask = {"mode": "dlq", "action": "requeue", "confirm": "yes", "next": "/dlq"}
    with _refused_at_commit(failing, "audit_pendingevent"):
        answer = client.post("/runs/matching", ask, follow=True)
    assert answer.status_code == 200
    said = answer.content.decode().split('id="messages"')[1].split("</ul>")[0]
    assert "Requeued 2 runs." in said
    assert "The runs of shards " in said and shards.span(failing) in said.split("shards")[1]
    assert shards.span(committing) not in said.split("shards")[1]
    assert [r.state for r in Run.objects.using(committing).filter(pk__in=[r.pk for r in kept])] == [
        "ready", "ready"
    ]  # fmt: skip
    assert not Run.objects.using(failing).filter(Q(pk__in=[r.pk for r in lost]), ~Q(state="dead"))


def test_an_action_on_everything_matching_whose_first_database_refuses_says_nothing_changed(
    layout: Layout, team_a, operator_a
):
    """A 500 page ("something failed on our side") before, over runs left as they were."""
    from contextlib import ExitStack

    from apps.runs.models import Run
    from tests.api.test_shard_databases_manage import _refused_at_commit

    dead = [run for alias in layout.aliases
            for run in layout.dead_runs(layout.job_on(alias, team_a, f"m{alias}"), 1, "m")]  # fmt: skip
    ask = {"mode": "dlq", "action": "requeue", "confirm": "yes", "next": "/dlq"}
    with ExitStack() as refusing:
        for alias in layout.aliases:
            refusing.enter_context(_refused_at_commit(alias, "audit_pendingevent"))
        answer = client_for(operator_a).post("/runs/matching", ask)
    assert answer.status_code == 503, answer.content[:300]
    text = answer.content.decode()
    assert "The database refused this change at its commit" in text
    assert "nothing was changed" in text
    for run in dead:
        assert Run.objects.using(shards.alias_of_run(run.pk)).get(pk=run.pk).state == "dead"


def test_ticked_runs_of_two_databases_one_failing_at_its_commit_are_said_as_they_are(
    layout: Layout, team_a, operator_a
):
    """The runs of each database are changed in its own transaction, one after the other: when
    a later one fails at its commit, the earlier ones' changes stand (a 500 page said nothing
    of them). The message says how many were changed and which shards' were not."""
    from apps.runs.models import Run
    from tests.api.test_shard_databases_manage import _refused_at_commit

    one = layout.dead_runs(layout.job_on(layout.aliases[0], team_a, "one"), 1, "o")[0]
    two = layout.dead_runs(layout.job_on(layout.aliases[1], team_a, "two"), 1, "t")[0]
    first, later = sorted([one, two], key=lambda run: run.pk)  # the order they are changed in
    failing = shards.alias_of_run(later.pk)
    ask = {"action": "requeue", "ids": [one.run_id, two.run_id], "confirm": "yes", "next": "/dlq"}
    with _refused_at_commit(failing, "audit_pendingevent"):
        answer = client_for(operator_a).post("/runs/bulk", ask, follow=True)
    assert answer.status_code == 200
    said = answer.content.decode().split('id="messages"')[1].split("</ul>")[0]
    assert f"Requeued 1 run. The runs of shards {shards.span(failing)} were not changed" in said
    assert Run.objects.using(shards.alias_of_run(first.pk)).get(pk=first.pk).state == "ready"
    assert Run.objects.using(failing).get(pk=later.pk).state == "dead"


def test_a_retry_of_waiting_and_dead_runs_says_what_it_changed_when_the_dead_ones_fail(
    layout: Layout, team_a, operator_a
):
    """A retry is two changes: the retrying runs skip their backoff, the dead ones are
    requeued. The second failing on its database answered a 503 page over the first's runs,
    which had changed."""
    from apps.runs.models import Run
    from tests.api.test_shard_databases_manage import _refused_at_commit

    waiting = layout.dead_runs(layout.job_on(layout.aliases[0], team_a, "wait"), 1, "w")[0]
    Run.objects.using(layout.aliases[0]).filter(pk=waiting.pk).update(state="retrying")
    dead = layout.dead_runs(layout.job_on(layout.aliases[1], team_a, "dead"), 1, "d")[0]
    ask = {"action": "retry", "ids": [waiting.run_id, dead.run_id], "confirm": "yes",
           "next": "/failures"}  # fmt: skip
    with _refused_at_commit(layout.aliases[1], "runs_run", "UPDATE"):
        answer = client_for(operator_a).post("/runs/bulk", ask, follow=True)
    assert answer.status_code == 200
    said = answer.content.decode().split('id="messages"')[1].split("</ul>")[0]
    span = shards.span(layout.aliases[1])
    assert f"Retried 1 run. The runs of shards {span} were not changed" in said
    assert Run.objects.using(layout.aliases[0]).get(pk=waiting.pk).state == "ready"
    assert Run.objects.using(layout.aliases[1]).get(pk=dead.pk).state == "dead"


def test_a_live_page_whose_database_is_down_for_a_moment_keeps_its_socket(
    layout: Layout, team_a, operator_a
):
    """A run's page re-rendered while its database is down: the error ended the socket, and
    the page's updates stopped until a reload. It keeps the socket and what it shows; once
    the database is back, the next render is sent."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    from apps.dashboard.consumers import LiveConsumer
    from tests.dashboard.conftest import live_scope
    from tests.dashboard.test_live import in_own_thread

    run = layout.dead_runs(layout.job_on(layout.aliases[1], team_a, "live"), 1, "l")[0]
    scope = live_scope(operator_a)

    async def render() -> tuple[list, list]:
        consumer = LiveConsumer()
        consumer.scope, consumer.page = scope, f"/runs/{run.run_id}"
        closed: list = []
        sent: list = []

        async def close(code=None, reason=None) -> None:
            closed.append(code)

        async def send(text_data=None, bytes_data=None, close=False) -> None:
            sent.append(text_data)

        consumer.close, consumer.send = close, send  # type: ignore[method-assign]
        await consumer._render()
        await sync_to_async(connections.close_all)()
        return closed, sent

    with layout.down(1):
        closed, sent = in_own_thread(render)
    assert (closed, sent) == ([], [])
    closed, sent = in_own_thread(render)
    assert closed == [] and len(sent) == 1 and run.run_id in sent[0]


def test_a_live_update_names_the_shards_it_could_not_read(layout: Layout, team_a, operator_a):
    """A list open while a database goes down: its live update dropped that database's rows
    without the banner a page load shows, so they looked gone. The update carries the banner,
    and takes it away once the database is back."""
    from apps.dashboard import live
    from tests.dashboard.conftest import live_scope

    for alias in layout.aliases:
        layout.new_runs(layout.job_on(alias, team_a, f"list{alias}"), 1, "r")
    scope = live_scope(operator_a)
    span = shards.span(layout.aliases[1])
    with layout.down(1):
        html = live.render(scope, "/runs")
    assert f"Shards {span} are unavailable" in html
    assert 'id="unavailable-banner"' in html
    html = live.render(scope, "/runs")
    assert 'id="unavailable-banner"></div>' in html and "are unavailable" not in html
