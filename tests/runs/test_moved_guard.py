"""The guard a shard move leaves on the database the shard left (migration runs/0022): new
rows of that shard refused, its existing rows written as usual; and the CHECK constraints of
moves made before it turned into that guard."""

from __future__ import annotations

import importlib

import pytest
from django.db import IntegrityError, connection, transaction

from apps.runs.models import Run
from tests.conftest import add_ready_runs, make_definition

pytestmark = pytest.mark.django_db(transaction=True)

MIGRATION = importlib.import_module("apps.runs.migrations.0022_moved_shard_insert_guard")


def test_an_old_moves_constraint_becomes_an_insert_guard(team_a):
    definition = make_definition(team_a, "guarded.job", queue="q")
    (run_id,) = add_ready_runs(definition, 1)
    shard = Run.objects.get(pk=run_id).shard
    name = f"shard_moved_{shard}"
    with connection.cursor() as cursor:
        cursor.execute(
            f"ALTER TABLE runs_run ADD CONSTRAINT {name} CHECK (shard <> {shard}) NOT VALID"
        )
    try:
        # As left by a move before the guard: even an update of the shard's row is refused.
        with pytest.raises(IntegrityError), transaction.atomic():
            Run.objects.filter(pk=run_id).update(worker_id="w")
        with connection.cursor() as cursor:
            cursor.execute(MIGRATION.REFUSE)
            cursor.execute("SELECT count(*) FROM pg_constraint WHERE conname = %s", [name])
            assert cursor.fetchone() == (0,)
        assert Run.objects.filter(pk=run_id).update(worker_id="w") == 1
        with pytest.raises(IntegrityError, match="has moved") as refused, transaction.atomic():
            add_ready_runs(definition, 1, prefix="after")
        assert refused.value.__cause__.diag.constraint_name == name
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON runs_run")
            cursor.execute(f"ALTER TABLE runs_run DROP CONSTRAINT IF EXISTS {name}")
