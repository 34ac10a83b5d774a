"""No unique index on an attempt's fencing token: the statements that end or beat an attempt
find it by its run and number (attempt_run_number), and the token is unique by construction
(each lease takes the next value of runs_fencing_token). The index was written twice per lease:
6.5 of ~71 µs PostgreSQL spent per run claimed and completed (bench/README.md)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0020_attempts_without_run_constraint"),
    ]

    operations = [
        migrations.AlterField(
            model_name="attempt",
            name="fencing_token",
            field=models.BigIntegerField(),
        ),
    ]
