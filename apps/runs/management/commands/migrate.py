"""`manage.py migrate`: the control database, then every shard database of the shard map.

Django's own command migrates one database; with shards on servers of their own each needs the
same schema (apps/runs/shards.py). `--database ALIAS` (or `--run-syncdb`, as the test runner
migrates each test database) still migrates that one alone.
"""

from __future__ import annotations

from django.core.management.commands.migrate import Command as DjangoMigrate
from django.db import DEFAULT_DB_ALIAS

from apps.runs import shards


class Command(DjangoMigrate):
    help = (
        "Migrate the control database and every shard database (SCHEDULER_SHARD_DATABASES); "
        "with --database, that database alone."
    )

    def handle(self, *args, **options) -> None:
        # The test runner migrates each test database on its own, with run_syncdb.
        if options["database"] != DEFAULT_DB_ALIAS or options["run_syncdb"]:
            super().handle(*args, **options)
            return
        shards.refresh(force=True)  # with the databases shards were moved to
        for alias in [DEFAULT_DB_ALIAS, *(a for a in shards.databases() if a != DEFAULT_DB_ALIAS)]:
            if alias != DEFAULT_DB_ALIAS and options["verbosity"]:
                self.stdout.write(self.style.MIGRATE_HEADING(f"Shard database {alias}:"))
            super().handle(*args, **{**options, "database": alias})
