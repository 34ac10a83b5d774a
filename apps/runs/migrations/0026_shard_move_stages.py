"""A shard move that dies at any step leaves nothing that runs twice (apps/scheduler/moves.py).

`moving_to` names the move's target (the copy there is the move's own) and `moving_from` its
source (the rows kept there after the flip are the move's to delete), `settles_at` holds
claims of the shard in its new database until every process has read the move, and
`shard_frozen_skip()` is the function of the freeze a move puts on the shard's rows in the
database it leaves (an UPDATE trigger `shard_frozen_<N>`: the rows are left as they are, so no
claim leases them there again once the copy is the shard's).
"""

from django.db import migrations, models

SKIP = """
CREATE OR REPLACE FUNCTION shard_frozen_skip() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NULL;  -- the row is left as it is (a claim that met it leases the others)
END
$$;
"""

UNDO = "DROP FUNCTION IF EXISTS shard_frozen_skip() CASCADE;"


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0025_payload_blob_stranded"),
    ]

    operations = [
        migrations.AddField(
            model_name="shardplacement",
            name="moving_to",
            field=models.TextField(blank=True, default=""),
        ),
        migrations.AddField(
            model_name="shardplacement",
            name="moving_from",
            field=models.TextField(blank=True, default=""),
        ),
        migrations.AddField(
            model_name="shardplacement",
            name="settles_at",
            field=models.DateTimeField(null=True),
        ),
        migrations.RunSQL(SKIP, UNDO),
    ]
