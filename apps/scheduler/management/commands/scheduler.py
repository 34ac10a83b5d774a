"""`python manage.py scheduler`: one scheduler node (see apps.scheduler.daemon)."""

from __future__ import annotations

import signal

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.scheduler.daemon import Scheduler
from apps.scheduler.models import ShardLease

# The shard leases' owner column: a longer id failed every tick (a traceback, exit 0).
NODE_ID_MAX = ShardLease._meta.get_field("owner").max_length


class Command(BaseCommand):
    help = "Hold shard leases, reap expired run leases and materialise due runs until SIGTERM."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--once", action="store_true", help="Run one tick, release the shards, exit."
        )
        parser.add_argument(
            "--node-id", default=None, help="Node id (default: hostname/pid/random)."
        )
        parser.add_argument(
            "--tick",
            type=float,
            default=None,
            help="Seconds between ticks (default: SCHEDULER_TICK_SECONDS).",
        )

    def handle(self, *args: object, **options: object) -> None:
        tick = options["tick"]
        if tick is not None and not 0 < float(tick) <= 3600:  # type: ignore[arg-type]
            raise CommandError("--tick must be a number of seconds above 0 and at most 3600.")
        node_id = options["node_id"]
        if node_id is not None and not 0 < len(str(node_id)) <= NODE_ID_MAX:
            raise CommandError(f"--node-id must be 1 to {NODE_ID_MAX} characters.")
        scheduler = Scheduler(node_id=options["node_id"], tick_seconds=options["tick"])
        # Handlers only flag the shutdown: the loop finishes its step and releases the shards.
        signal.signal(signal.SIGTERM, scheduler.stop)
        signal.signal(signal.SIGINT, scheduler.stop)
        scheduler.run(once=bool(options["once"]))
