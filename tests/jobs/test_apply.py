"""Jobs as code: `manage.py apply` and `PUT /api/v1/jobs` show the diff and apply it, audited."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from apps.audit.models import AuditEvent
from apps.jobs.models import JobDefinition
from tests.conftest import make_definition

pytestmark = pytest.mark.django_db

FILE = """
team: team-a
jobs:
  - name: billing.export-invoices
    schedule: {cron: "0 2 * * *", timeZone: Europe/Berlin}
    queue: billing
    priority: critical
  - name: billing.reminders
    schedule: {cron: "0 9 * * 1-5"}
    queue: billing
"""


def apply(tmp_path, text: str, *args: str) -> str:
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    out = StringIO()
    call_command("apply", str(path), *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_dry_run_prints_the_diff_and_changes_nothing(tmp_path, team_a):
    make_definition(team_a, "billing.old", queue="billing")
    out = apply(tmp_path, FILE, "--dry-run", "--prune")
    assert (
        "+ billing.export-invoices" in out
        and "+ billing.reminders" in out
        and "- billing.old" in out
    )
    assert "Dry run" in out
    assert sorted(JobDefinition.objects.values_list("name", flat=True)) == ["billing.old"]
    assert AuditEvent.objects.count() == 0


def test_apply_creates_updates_and_prunes_each_audited(tmp_path, team_a):
    make_definition(team_a, "billing.old", queue="billing")
    apply(tmp_path, FILE)
    assert JobDefinition.objects.count() == 3
    changed = FILE.replace('"0 9 * * 1-5"', '"0 10 * * 1-5"')
    out = apply(tmp_path, changed, "--prune")
    assert "~ billing.reminders" in out and '"0 9 * * 1-5"' in out and "- billing.old" in out
    assert sorted(JobDefinition.objects.values_list("name", flat=True)) == [
        "billing.export-invoices",
        "billing.reminders",
    ]
    actions = list(AuditEvent.objects.order_by("id").values_list("action", "source"))
    assert actions == [
        ("job.create", "cli"),
        ("job.create", "cli"),
        ("job.update", "cli"),
        ("job.delete", "cli"),
    ]
    assert "0 create, 0 update, 0 delete, 2 unchanged" in apply(tmp_path, changed, "--prune")


def test_an_invalid_entry_changes_nothing(tmp_path, team_a):
    bad = (
        FILE
        + "  - name: billing.broken\n    schedule: {cron: '99 * * * *'}\n    priority: urgent\n"
    )
    err = StringIO()
    path = tmp_path / "jobs.yaml"
    path.write_text(bad)
    with pytest.raises(CommandError):
        call_command("apply", str(path), stdout=StringIO(), stderr=err)
    # Each error names the field and the line it was written on.
    assert "jobs[2].schedule.cron (line 12):" in err.getvalue()
    assert "jobs[2].priority (line 13):" in err.getvalue()
    assert JobDefinition.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_put_jobs_syncs_the_same_way(api_a, team_a):
    make_definition(team_a, "billing.old", queue="billing")
    body = {"jobs": [{"name": "billing.new", "queue": "billing"}], "prune": True, "dryRun": True}
    preview = api_a.put("/api/v1/jobs", body)
    assert preview.status_code == 200, preview.text
    assert preview.json()["summary"] == {"create": 1, "update": 0, "delete": 1, "unchanged": 0}
    assert preview.json()["applied"] is False
    assert JobDefinition.objects.count() == 1
    done = api_a.put("/api/v1/jobs", {**body, "dryRun": False}).json()
    assert done["applied"] is True
    assert list(JobDefinition.objects.values_list("name", flat=True)) == ["billing.new"]
    assert set(AuditEvent.objects.values_list("source", flat=True)) == {"api"}
    bad = api_a.put("/api/v1/jobs", {"jobs": [{"name": "Bad!"}]})
    assert bad.status_code == 400 and "jobs[0].name" in bad.json()["errors"]


@pytest.mark.django_db(transaction=True)
def test_a_schedule_with_its_defaults_written_out_is_unchanged(api_a, team_a):
    job = {"name": "billing.new", "queue": "billing", "schedule": {"cron": "0 9 * * *"}}
    api_a.put("/api/v1/jobs", {"jobs": [job]})
    # A row that holds its schedule without the defaults (as rows written before the API
    # wrote them out do); the API's answer spells them out.
    JobDefinition.objects.update(schedule={"cron": "0 9 * * *"})
    again = api_a.put("/api/v1/jobs", {"jobs": [job]}).json()
    assert again["summary"] == {"create": 0, "update": 0, "delete": 0, "unchanged": 1}, again
    assert JobDefinition.objects.get().schedule == {"cron": "0 9 * * *"}
    assert AuditEvent.objects.filter(action="job.update").count() == 0


@pytest.mark.parametrize("depth", [62, 65, 5000])
def test_a_file_with_a_payload_nested_past_the_limit_changes_nothing(tmp_path, team_a, depth):
    # Counted from the file's own level, as PUT /api/v1/jobs counts its body's: the file, its
    # `jobs` list and the entry leave a payload 61 levels of its own.
    nested = "[" * depth + "]" * depth
    text = f"team: team-a\njobs:\n  - name: deep.job\n    queue: q\n    payload: {nested}\n"
    with pytest.raises(CommandError, match=r"jobs\[0\]\.payload|too deeply"):
        apply(tmp_path, text)
    assert not JobDefinition.objects.exists()


def test_a_file_and_put_jobs_take_the_same_nesting(api_a, tmp_path, team_a):
    entry = {"name": "deep.job", "queue": "q", "payload": [[[]]]}
    for depth in (61, 62):
        entry["payload"] = json.loads("[" * depth + "]" * depth)
        by_api = api_a.put("/api/v1/jobs", {"jobs": [entry], "dryRun": True}).status_code
        text = f"team: team-a\njobs:\n  - {json.dumps(entry)}\n"
        try:
            apply(tmp_path, text, "--dry-run")
            by_file = 200
        except CommandError:
            by_file = 400
        assert by_api == by_file == (200 if depth == 61 else 400), depth


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ("123456789012345678901234567890", "outside 64 bits"),
        (".nan", "which JSON has no number for"),
        (".inf", "which JSON has no number for"),
        ('"a\\0b"', "NUL character"),
        ('{"k\\0": 1}', "NUL character"),
        ("!!set {a, b}", "set"),
        ("!!binary aGVsbG8=", "bytes"),
    ],
    ids=["wide-integer", "nan", "inf", "nul", "nul-key", "set", "binary"],
)
def test_a_value_no_api_body_may_hold_is_refused_before_anything_changes(
    tmp_path, team_a, payload, reason
):
    text = f"team: team-a\njobs:\n  - name: odd.job\n    queue: q\n    payload: {payload}\n"
    for args in (["--dry-run"], []):
        with pytest.raises(CommandError, match=reason) as refused:
            apply(tmp_path, text, *args)
        if reason in ("outside 64 bits", "NUL character"):  # as an API body would be, named so
            assert "jobs[0].payload (line 5):" in str(refused.value)
    assert not JobDefinition.objects.exists()


def test_yaml_keys_that_are_not_text_are_written_as_json_writes_them(tmp_path, team_a):
    text = "team: team-a\njobs:\n  - name: keys.job\n    queue: q\n    payload: {on: 1, 2: b}\n"
    apply(tmp_path, text)
    assert JobDefinition.objects.get().payload == {"true": 1, "2": "b"}


def test_a_number_written_with_an_exponent_and_no_dot_is_a_number(tmp_path, team_a):
    """YAML 1.1 read `1e25` as the text "1e25"; JSON and YAML 1.2 read a number."""
    text = (
        "team: team-a\njobs:\n  - name: exp.job\n    queue: q\n"
        '    payload: {big: 1e25, small: -2E-3, text: "1e25", version: 1e2e}\n'
    )
    apply(tmp_path, text)
    payload = JobDefinition.objects.get().payload
    assert payload == {"big": 10**25, "small": -0.002, "text": "1e25", "version": "1e2e"}


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xff\xfe\x00garbage", "not UTF-8"),
        (b"jobs: &a [{name: a.r, queue: q, payload: *a}]\nteam: team-a\n", "contains itself"),
        (b"team: team-a\nteam: team-b\njobs: []\n", "given twice"),
        # Spelt two ways, one key once JSON holds it: one of them was dropped without a word.
        (b"team: team-a\njobs: [{name: a.r, queue: q, payload: {1: x, '1': y}}]\n", "given twice"),
        (b"team: team-a\njobs: [{name: a.r, queue: q, payload: {on: x, 'true': y}}]\n", "twice"),
        # A list or a mapping as a key was a TypeError's traceback.
        (b"team: team-a\njobs:\n  - ? [a, b]\n    : 1\n", "is no JSON key"),
        (b"team: team-a\njobs: [{name: a.r, queue: q, payload: {? {k: 1} : 2}}]\n", "no JSON"),
        (b"team: team-a\nbase: &b {queue: q}\njobs:\n  - <<: *b\n    name: a.r\n", "merge keys"),
        (
            b"team: team-a\na: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + b"".join(
                f"{chr(98 + n)}: &{chr(98 + n)} [{', '.join(['*' + chr(97 + n)] * 10)}]\n".encode()
                for n in range(8)
            )
            + b"jobs: [{name: a.r, queue: q, payload: *i}]\n",
            "more than 2000000 values",
        ),
    ],
    ids=[
        "not-utf8",
        "self-reference",
        "duplicate-key",
        "duplicate-key-as-json",
        "duplicate-bool-key-as-json",
        "list-key",
        "mapping-key",
        "merge-key",
        "billion-laughs",
    ],
)
def test_a_hostile_file_is_an_error_not_a_traceback(tmp_path, team_a, content, reason):
    path = tmp_path / "jobs.yaml"
    path.write_bytes(content)
    with pytest.raises(CommandError, match=reason):
        call_command("apply", str(path), stdout=StringIO(), stderr=StringIO())
    assert not JobDefinition.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_job_deleted_after_the_plan_was_made_changes_nothing(team_a):
    """Another client deletes a job the plan updates: the sync stops with a 404's error (it
    was a DoesNotExist, a 500 through PUT /api/v1/jobs), and nothing of it is applied."""
    from apps.api.shapes.jobs import parse_definition
    from apps.audit.record import Actor
    from apps.jobs import sync
    from apps.jobs.models import DefinitionGone

    make_definition(team_a, "billing.reminders", queue="billing")
    entries = [
        {"name": "billing.reminders", "queue": "billing", "priority": "critical"},
        {"name": "billing.new", "queue": "billing"},
    ]
    plan = sync.plan_sync(team_a, sync.validate(entries, parse_definition), prune=False)
    JobDefinition.objects.filter(name="billing.reminders").delete()
    with pytest.raises(DefinitionGone):
        sync.apply_sync(plan, Actor.cli())
    assert not JobDefinition.objects.exists()


def test_a_name_given_twice_is_said_with_the_other_entrys_errors(team_a):
    """Said only once both entries parsed: a file fixed for its cron then failed for the name."""
    from apps.api.shapes.jobs import parse_entry
    from apps.jobs import sync

    entries = [
        {"name": "dd.x", "queue": "q"},
        {"name": "dd.x", "queue": "q", "schedule": {"cron": "99 * * * *"}},
    ]
    with pytest.raises(sync.SyncError) as raised:
        sync.validate(entries, parse_entry)
    errors = raised.value.errors
    assert errors["jobs[1].name"] == ["'dd.x' appears twice."]
    assert any(path.startswith("jobs[1].schedule") for path in errors), errors
