"""The dashboard with shards on servers of their own: every page reads every shard database, and
one that is down is named in a banner while the page shows the rest (a page about one run or
job of it says so instead)."""

from __future__ import annotations

import pytest

from apps.runs import shards
from tests.conftest import Layout
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
