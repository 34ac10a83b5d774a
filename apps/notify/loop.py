"""The notifier: detection and delivery, as steps of the scheduler process.

Shaped like the scheduler's own loop (apps/scheduler/daemon.py): each step is a
`handle_one_…() -> bool` method ("did work, call me again") that tests call directly. The
scheduler runs `run` in a thread of its own, so a slow webhook (up to the timeout) never delays
the shard leases' renewals. That thread detects and prunes; SCHEDULER_NOTIFY_SENDERS threads
beside it send, each claiming one delivery at a time, so a receiver that answers slowly (or
not at all, for the whole timeout) neither holds up other teams' pages nor the next look for
events. Every thread has its own database connection and closes it on exit.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections, connection

from apps.notify import detect, outbox
from apps.runs.clock import database_now

log = logging.getLogger(__name__)

# The delivery log and closed incidents are pruned this often (seconds), after
# SCHEDULER_RETENTION_DAYS, as finished runs are.
PRUNE_SECONDS = 3600
PRUNE_BATCH = 1000


class Notifier:
    def __init__(self) -> None:
        self._detected_at = float("-inf")
        self._pruned_at = float("-inf")

    def handle_one_detection(self, *, force: bool = False) -> bool:
        """Look for events, when the interval has passed (or `force`); return True when a
        batch was full and another look should follow at once."""
        if not force and (
            time.monotonic() - self._detected_at < settings.SCHEDULER_NOTIFY_INTERVAL_SECONDS
        ):
            return False
        self._detected_at = time.monotonic()
        return detect.detect(database_now())

    def handle_one_delivery(self) -> bool:
        """Send the next due delivery; return True when there was one."""
        return outbox.deliver_next()

    def handle_one_prune(self, *, force: bool = False) -> bool:
        """Delete one batch of old deliveries and closed incidents, when an hour has passed
        (or `force`); return True when the batch was full."""
        if not force and time.monotonic() - self._pruned_at < PRUNE_SECONDS:
            return False
        self._pruned_at = time.monotonic()
        before = database_now() - timedelta(days=settings.SCHEDULER_RETENTION_DAYS)
        return outbox.prune(before, PRUNE_BATCH) >= PRUNE_BATCH

    def run(self, stop: threading.Event, *, pause: float = 1.0) -> None:
        """Detect and prune, with the sender threads sending, until `stop` is set."""
        senders = [
            threading.Thread(
                target=self.send, args=(stop, pause), name=f"notifier-send-{n}", daemon=True
            )
            for n in range(settings.SCHEDULER_NOTIFY_SENDERS)
        ]
        for sender in senders:
            sender.start()
        try:
            self._loop(stop, pause, self._look)
        finally:
            for sender in senders:
                sender.join(settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS + 5)

    def send(self, stop: threading.Event, pause: float = 1.0) -> None:
        """Send due deliveries until `stop` is set (one sender thread)."""
        self._loop(stop, pause, self._send_due)

    def _look(self, stop: threading.Event) -> None:
        while self.handle_one_detection() and not stop.is_set():
            pass
        for batch in range(10):  # a few batches: the first may be a backlog
            if stop.is_set() or not self.handle_one_prune(force=batch > 0):
                break

    def _send_due(self, stop: threading.Event) -> None:
        while not stop.is_set() and self.handle_one_delivery():
            pass

    @staticmethod
    def _loop(stop: threading.Event, pause: float, step) -> None:
        try:
            while not stop.is_set():
                try:
                    step(stop)
                except Exception:
                    # A lost database or a bug must not end the notifier: try again next round.
                    log.exception("notifier round failed; retrying")
                    connection.close()
                close_old_connections()
                stop.wait(pause)
        finally:
            connection.close()


def start(name: str = "notifier") -> tuple[threading.Thread, threading.Event]:
    """Run a Notifier in a daemon thread; set the event to stop it."""
    stop = threading.Event()
    thread = threading.Thread(target=Notifier().run, args=(stop,), name=name, daemon=True)
    thread.start()
    return thread, stop
