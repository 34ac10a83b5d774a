from django.db import migrations


class Migration(migrations.Migration):
    """Vacuum the hot tables without the cost-based pause.

    Each run leaves two dead versions in runs_run and one in runs_attempt. Throttled (2 ms
    asleep per 200 cost units), vacuum fell behind them in the benchmark's 10-minute soak at a
    few thousand runs a second (bench/README.md, "Soak"); unthrottled, a pass does the same
    work without the pauses.
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
