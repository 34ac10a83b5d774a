"""Two indexes fewer on jobs_jobdefinition, which the materialiser updates once per fire time.

The team's index repeats the first column of job_team_name. The name's varchar_pattern_ops index
(PostgreSQL's backend adds one to every unique CharField) serves only case-sensitive prefix
matches, and nothing here searches names that way (the dashboard's search is case-insensitive).
"""

from django.db import migrations, models

LIKE_INDEX = "jobs_jobdefinition_name_22011aa0_like"


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0004_owner_runbook_slo"),
        ("teams", "0001_initial"),
    ]

    operations = [
        migrations.AlterField(
            model_name="jobdefinition",
            name="team",
            field=models.ForeignKey(
                db_index=False,
                on_delete=models.deletion.CASCADE,
                related_name="jobs",
                to="teams.team",
            ),
        ),
        migrations.RunSQL(
            f"DROP INDEX IF EXISTS {LIKE_INDEX}",
            f"CREATE INDEX IF NOT EXISTS {LIKE_INDEX} ON jobs_jobdefinition "
            "(name varchar_pattern_ops)",
        ),
    ]
