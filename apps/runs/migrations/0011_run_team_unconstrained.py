import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    """A run's team without a foreign key constraint in the database (see Run.team)."""

    dependencies = [
        ("runs", "0010_concurrency_key"),
        ("teams", "0003_signin_failure"),
    ]

    operations = [
        migrations.AlterField(
            model_name="run",
            name="team",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to="teams.team",
            ),
        ),
    ]
