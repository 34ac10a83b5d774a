"""A moved shard's guard refuses new rows only: an insert trigger instead of a CHECK constraint.

`manage.py moveshard` kept a shard's rows out of the database it leaves with `CHECK (shard <> N)
NOT VALID`. A CHECK holds for every row version written, updates included: while the shard was
moving, completing or heartbeating one of its leased runs, reaping it, or a claim that met one of
its waiting runs (failing the whole claim, every shard of that database with it) broke the
constraint, and the move could not finish while a worker held a run there. The guard is now a
trigger on INSERT (`shard_moved_<N>`, raising check_violation under that name, as the
constraint did, so callers tell it apart the same way). Guards left by earlier moves are
turned into triggers here.
"""

from django.db import migrations

REFUSE = """
CREATE OR REPLACE FUNCTION shard_moved_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'a new row of shard % in %: the shard has moved (or is moving) away',
        NEW.shard, TG_TABLE_NAME
        USING ERRCODE = 'check_violation', CONSTRAINT = TG_NAME;
END
$$;

DO $$
DECLARE
    c record;
BEGIN
    FOR c IN
        SELECT conrelid::regclass AS tbl, conname FROM pg_constraint
        WHERE contype = 'c' AND conname LIKE 'shard\\_moved\\_%'
    LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', c.tbl, c.conname);
        EXECUTE format(
            'CREATE TRIGGER %I BEFORE INSERT ON %s FOR EACH ROW WHEN (NEW.shard = %s)'
            ' EXECUTE FUNCTION shard_moved_refuse()',
            c.conname, c.tbl, substring(c.conname FROM 'shard_moved_([0-9]+)$')::int
        );
    END LOOP;
END
$$;
"""

UNDO = "DROP FUNCTION IF EXISTS shard_moved_refuse() CASCADE;"


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0021_attempts_found_by_run"),
    ]

    operations = [migrations.RunSQL(REFUSE, UNDO)]
