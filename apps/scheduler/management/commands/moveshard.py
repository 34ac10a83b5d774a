"""`manage.py moveshard N --to URL`: move shard N to another PostgreSQL database in a
maintenance window (apps/scheduler/moves.py says how, step by step)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from apps.scheduler import moves


class Command(BaseCommand):
    help = (
        "Move one shard's definitions, runs and attempts to another database: its new runs "
        "are refused and its leased runs waited for while the rows are copied and compared; "
        "then the map points at the target and the old rows are deleted."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("shard", type=int)
        parser.add_argument("--to", required=True, metavar="URL", help="postgresql://…")
        parser.add_argument(
            "--wait",
            type=float,
            default=300.0,
            help="seconds to wait for the shard's leased runs to finish (default 300)",
        )

    def handle(self, *args, shard: int, to: str, wait: float, **options) -> None:
        if not to.startswith(("postgresql://", "postgres://")):
            raise CommandError("--to must be a postgresql:// URL.")
        if not 0 <= wait <= 86_400:  # NaN too
            raise CommandError("--wait must be a number of seconds from 0 to 86400.")
        try:
            moved = moves.move(shard, to, wait=wait, say=self.stdout.write)
        except moves.MoveError as exc:
            raise CommandError(str(exc)) from exc
        except ValueError as exc:  # a URL that does not parse (postgresql://[bad)
            raise CommandError(f"--to is not a URL this can read: {exc}") from exc
        except DatabaseError as exc:  # a URL the server refuses (a bad option, a wrong password)
            raise CommandError(f"The move failed and was undone: {exc}".strip()) from exc
        if moved.finished_only:
            self.stdout.write(self.style.SUCCESS(f"Shard {shard} was already there."))
            return
        rows = ", ".join(f"{table} {count}" for table, count in moved.rows.items())
        self.stdout.write(
            self.style.SUCCESS(
                f"Moved shard {shard} (waited {moved.waited:.1f} s for leased runs): {rows};"
                " counts and checksums equal on both databases."
            )
        )
