from django.db import migrations


def count_recent_attempts(apps, schema_editor) -> None:
    # The overview now reads these counters: start them from the attempts already stored.
    from apps.runs import counters, shards

    with shards.using(schema_editor.connection.alias):
        counters.rebuild()


class Migration(migrations.Migration):
    dependencies = [("runs", "0006_minute_counts")]

    operations = [migrations.RunPython(count_recent_attempts, migrations.RunPython.noop)]
