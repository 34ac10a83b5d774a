import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    """The team key without a database constraint: teams live in the control database,
    definitions and their counts in their shard's (apps/runs/shards.py)."""

    dependencies = [
        ("jobs", "0005_fewer_definition_indexes"),
        ("teams", "0003_signin_failure"),
    ]

    operations = [
        migrations.AlterField(
            model_name="jobdefinition",
            name="team",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="jobs",
                to="teams.team",
            ),
        ),
    ]
