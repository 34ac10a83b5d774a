"""Triage: each failed run's error fingerprint and failure time, the index that groups them, and
each attempt's stack trace."""

from django.db import migrations, models

BATCH = 5000

# The failure time of runs that failed before this column: their last attempt's end.
FAILED_AT = """
UPDATE runs_run r SET failed_at = a.ended_at
FROM (SELECT run_id, max(ended_at) AS ended_at FROM runs_attempt GROUP BY run_id) AS a
WHERE a.run_id = r.id AND r.state IN ('retrying', 'dead') AND r.failed_at IS NULL
"""


def fingerprint_failed_runs(apps, schema_editor):
    """The fingerprint of every retrying and dead run's last error, a batch at a time (the
    normalisation is Python's: apps/runs/fingerprints.py)."""
    from apps.runs import fingerprints

    after = -1
    with schema_editor.connection.cursor() as cursor:
        while True:
            cursor.execute(
                "SELECT id, last_error->>'type', last_error->>'message' FROM runs_run"
                " WHERE state IN ('retrying', 'dead') AND id > %s ORDER BY id LIMIT %s",
                [after, BATCH],
            )
            rows = cursor.fetchall()
            if not rows:
                return
            cursor.execute(
                "UPDATE runs_run r SET error_fingerprint = f.fingerprint"
                " FROM unnest(%s::bigint[], %s::bigint[]) AS f(id, fingerprint) WHERE r.id = f.id",
                [
                    [row[0] for row in rows],
                    [fingerprints.of(row[1] or "", row[2] or "") for row in rows],
                ],
            )
            after = rows[-1][0]


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0010_queue_rate_limit"),
        ("runs", "0017_limited_runs_apart"),
        ("teams", "0003_signin_failure"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="error_fingerprint",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="run",
            name="failed_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="attempt",
            name="error_stack",
            field=models.TextField(blank=True, db_default="", default=""),
        ),
        migrations.RunSQL(FAILED_AT, migrations.RunSQL.noop),
        migrations.RunPython(fingerprint_failed_runs, migrations.RunPython.noop),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(("state__in", ("retrying", "dead"))),
                fields=["team", "error_fingerprint", "state", "id"],
                include=("definition", "failed_at"),
                name="run_failed_by_fingerprint",
            ),
        ),
    ]
