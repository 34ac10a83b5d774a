from django.db import migrations, models


class Migration(migrations.Migration):
    """A run's concurrencyKey, set by the application that enqueues it.

    Nullable without a default: PostgreSQL adds the column without rewriting runs_run."""

    dependencies = [("runs", "0009_vacuum_unthrottled")]

    operations = [
        migrations.AddField(
            model_name="run",
            name="concurrency_key",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
    ]
