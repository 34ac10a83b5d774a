"""Turn expired leases into failed attempts, in a loop (the scheduler also does this)."""

from __future__ import annotations

import logging
import signal
import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections, connection

from apps.runs import shards, store

logger = logging.getLogger(__name__)


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--once", action="store_true", help="reap until nothing is expired, then exit"
        )
        parser.add_argument("--interval", type=float, default=1.0)

    def handle(self, *args, once: bool, interval: float, **options) -> None:
        if not 0 < interval <= 3600:  # NaN too
            raise CommandError("--interval must be a number of seconds above 0 and at most 3600.")
        self.shutdown = False
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        while not self.shutdown:
            close_old_connections()
            shards.refresh()
            try:
                while self.handle_one_batch() and not self.shutdown:
                    pass
            except Exception:
                if once:
                    raise
                # A lost database (a restart, a failover, a killed connection) must not end the
                # daemon: the next round starts on a fresh connection.
                logger.exception("reaping failed; retrying in %.1fs", interval)
                connection.close()
            if once:
                break
            time.sleep(interval)

    def on_signal(self, signum, frame) -> None:
        self.shutdown = True

    def handle_one_batch(self) -> bool:
        """Reap one batch; return whether it found anything (call again at once if so)."""
        reaped = store.reap(batch=settings.SCHEDULER_REAPER_BATCH)
        for item in reaped:
            logger.info("reaped run %s: %s → %s", item.id, item.outcome, item.state)
        return len(reaped) == settings.SCHEDULER_REAPER_BATCH
