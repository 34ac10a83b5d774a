"""The dead runs by the time they died, for the notifier's `run.dead` detector.

An index on `runs_run`, declared here because only the notifier reads it: apps/notify/detect.py
reads the dead runs after its watermark, `(finished_at, id) > (…)` in that order. Partial, so
only runs that die are written to it (a completion or a claim never is). Built CONCURRENTLY:
writes to the runs table go on while it is built. Every database gets it (one schema
everywhere), as every database may hold shards.
"""

from django.db import migrations

CREATE = """
CREATE INDEX CONCURRENTLY IF NOT EXISTS notify_run_dead_by_end
ON runs_run (finished_at, id) WHERE state = 'dead'
"""
DROP = "DROP INDEX CONCURRENTLY IF EXISTS notify_run_dead_by_end"


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("notify", "0001_initial"),
        ("runs", "0017_limited_runs_apart"),
    ]

    operations = [migrations.RunSQL(CREATE, DROP)]
