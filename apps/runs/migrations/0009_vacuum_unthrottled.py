from django.db import migrations


class Migration(migrations.Migration):
    """Vacuum the hot tables without the cost-based pause.

    Each run leaves two dead versions in runs_run and one in runs_attempt. Throttled vacuum
    (2 ms asleep per 200 cost units) took longer over these tables than they took to fill with
    new dead versions at a few thousand runs a second, so it never caught up (bench/README.md,
    soak). Unthrottled, a pass does the same work in a fraction of the time.
    """

    dependencies = [("runs", "0008_claimable_includes_state")]

    operations = [
        migrations.RunSQL(
            "ALTER TABLE runs_run SET (autovacuum_vacuum_cost_delay = 0);"
            " ALTER TABLE runs_attempt SET (autovacuum_vacuum_cost_delay = 0,"
            " autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);",
            "ALTER TABLE runs_run RESET (autovacuum_vacuum_cost_delay);"
            " ALTER TABLE runs_attempt RESET (autovacuum_vacuum_cost_delay,"
            " autovacuum_vacuum_scale_factor, autovacuum_analyze_scale_factor);",
        ),
    ]
