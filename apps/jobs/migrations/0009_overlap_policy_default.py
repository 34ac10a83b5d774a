from django.db import migrations


class Migration(migrations.Migration):
    """Write the default overlapPolicy into every stored cron schedule.

    A schedule is stored in its canonical form, defaults filled in, and answered as stored.
    Without this, definitions saved before overlapPolicy existed would answer without it, and
    the first `apply` of an unchanged file would report (and audit) a schedule change for
    every cron job. Reversed: the default is taken out again.
    """

    dependencies = [("jobs", "0008_rate_blocked_until")]

    operations = [
        migrations.RunSQL(
            "UPDATE jobs_jobdefinition"
            ' SET schedule = schedule || \'{"overlapPolicy": "allow_all"}\'::jsonb'
            " WHERE schedule ? 'cron' AND NOT schedule ? 'overlapPolicy'",
            "UPDATE jobs_jobdefinition SET schedule = schedule - 'overlapPolicy'"
            " WHERE schedule ->> 'overlapPolicy' = 'allow_all'",
        ),
    ]
