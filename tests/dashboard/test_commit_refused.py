"""A change the database refuses at its commit (a deferred constraint, a trigger: the database
answered, so its transaction was rolled back) is said as such: nothing was changed. The
dashboard's actions answered the generic "something failed" page, the API a bare 500."""

from __future__ import annotations

import pytest

from apps.audit.models import AuditEvent
from apps.jobs.models import JobDefinition
from apps.runs.models import Run
from tests.api.test_shard_databases_manage import _refused_at_commit
from tests.dashboard.conftest import client_for, failed_runs

pytestmark = pytest.mark.django_db(transaction=True)


def _said(answer) -> str:
    assert answer.status_code == 503, answer.content[:300]
    assert answer["Retry-After"] == "1"
    return answer.content.decode()


def test_a_resume_refused_at_its_commit_says_nothing_was_changed(job_a, operator_a):
    JobDefinition.objects.filter(pk=job_a.pk).update(paused=True)
    with _refused_at_commit("default", "jobs_jobdefinition", "UPDATE"):
        answer = client_for(operator_a).post(f"/jobs/{job_a.name}/resume")
    text = _said(answer)
    assert "The database refused this change at its commit" in text
    assert "nothing was changed" in text
    assert "Something failed on our side" not in text
    assert "<title>Change refused" in text and "A constraint or a trigger" in text
    assert JobDefinition.objects.get(pk=job_a.pk).paused
    assert not AuditEvent.objects.filter(action="job.resume").exists()


def test_a_requeue_refused_at_its_commit_says_nothing_was_changed(job_a, operator_a):
    run = failed_runs(job_a)[0]
    with _refused_at_commit("default", "runs_run", "UPDATE"):
        answer = client_for(operator_a).post(f"/runs/{run.run_id}/requeue")
    assert "nothing was changed" in _said(answer)
    assert Run.objects.get(pk=run.pk).state == "dead"


def test_a_job_edit_refused_at_its_commit_keeps_the_form_and_says_why(job_a, editor_a):
    from tests.dashboard.test_job_form import FORM

    client = client_for(editor_a)
    form = {**FORM, "name": job_a.name, "queue": job_a.queue, "timeout_seconds": "77"}
    with _refused_at_commit("default", "jobs_jobdefinition", "UPDATE"):
        answer = client.post(f"/jobs/{job_a.name}/edit", form)
    assert answer.status_code == 200, answer.content[:300]
    text = answer.content.decode()
    assert "The database refused this change at its commit" in text
    assert 'value="77"' in text
    assert JobDefinition.objects.get(pk=job_a.pk).timeout_seconds != 77


def test_the_api_says_a_change_refused_at_its_commit_changed_nothing(api_a):
    created = api_a.put("/api/v1/jobs/billing.nightly", {"queue": "q"})
    assert created.status_code == 201, created.text
    with _refused_at_commit("default", "jobs_jobdefinition", "UPDATE"):
        answer = api_a.patch("/api/v1/jobs/billing.nightly", {"timeoutSeconds": 77})
    assert answer.status_code == 503, answer.text
    assert answer.headers["Content-Type"] == "application/problem+json"
    assert answer.headers["Retry-After"] == "1"
    problem = answer.json()
    assert problem["status"] == 503
    assert problem["detail"].startswith("The database refused this change at its commit")
    assert problem["detail"].endswith("nothing was changed; try again.")
    assert api_a.get("/api/v1/jobs/billing.nightly").json()["timeoutSeconds"] != 77
