import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    """The team key without a database constraint: teams live in the control database,
    definitions and their counts in their shard's (apps/runs/shards.py)."""

    dependencies = [
        ("runs", "0011_run_team_unconstrained"),
        ("teams", "0003_signin_failure"),
    ]

    operations = [
        migrations.AlterField(
            model_name="minutecounts",
            name="team",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                to="teams.team",
            ),
        ),
    ]
