from django.db import migrations


class Migration(migrations.Migration):
    """Sequences of the claim path: fencing tokens (one for all leases) and the fairness tick."""

    dependencies = [("runs", "0001_initial")]

    operations = [
        migrations.RunSQL(
            "CREATE SEQUENCE runs_fencing_token; CREATE SEQUENCE runs_claim_tick CYCLE MAXVALUE 2000000000;",
            "DROP SEQUENCE runs_fencing_token; DROP SEQUENCE runs_claim_tick;",
        ),
        # Hot, short-lived rows: vacuum the runs table sooner than the default 20 % of dead tuples.
        migrations.RunSQL(
            "ALTER TABLE runs_run SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02,"
            " fillfactor = 80);",
            "ALTER TABLE runs_run RESET (autovacuum_vacuum_scale_factor, autovacuum_analyze_scale_factor, fillfactor);",
        ),
    ]
