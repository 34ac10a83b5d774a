"""Long-poll wake-ups: one LISTEN connection per process, shared by every waiting claim.

A claim that finds nothing waits on a condition that the listener thread signals whenever a
NOTIFY on `runs_ready` arrives (sent once per queue by the transaction that made runs claimable).
Runs that become claimable by the clock alone (a scheduled availableAt, the end of a backoff)
send no NOTIFY, so the waiter also sets its own alarm for the next availableAt it knows of.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg
from django.db import connections

from apps.runs.store import READY_CHANNEL

logger = logging.getLogger(__name__)


class ReadyListener:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._generation = 0
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.connected = threading.Event()
        self._stopping = threading.Event()

    @property
    def generation(self) -> int:
        return self._generation

    def ensure_started(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="runs-ready-listener", daemon=True
                )
                self._thread.start()
        # The first claim after start-up must not miss a NOTIFY sent while we were connecting.
        self.connected.wait(timeout=5)

    def stop(self, timeout: float = 5) -> None:
        """Stop listening and close the connection (tests, and processes that exit cleanly)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None
        self._stopping.clear()
        self.connected.clear()

    def wait(self, seen_generation: int, timeout: float) -> bool:
        """Block until a NOTIFY newer than `seen_generation` arrives or `timeout` passes."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._condition:
            while self._generation == seen_generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._condition.wait(left)
            return True

    def _wake(self) -> None:
        with self._condition:
            self._generation += 1
            self._condition.notify_all()

    def _conninfo(self) -> dict:
        settings = connections["default"].settings_dict
        params = {
            "dbname": settings["NAME"],
            "user": settings["USER"] or None,
            "password": settings["PASSWORD"] or None,
            "host": settings["HOST"] or None,
            "port": settings["PORT"] or None,
            "application_name": "scheduler:listener",
            "autocommit": True,
        }
        return {key: value for key, value in params.items() if value is not None}

    def _run(self) -> None:
        delay = 0.5
        while not self._stopping.is_set():
            try:
                with psycopg.connect(**self._conninfo()) as conn:
                    conn.execute(f"LISTEN {READY_CHANNEL}")
                    self.connected.set()
                    delay = 0.5
                    # Anything may have happened while we were not listening.
                    self._wake()
                    while not self._stopping.is_set():
                        for _ in conn.notifies(timeout=1):
                            self._wake()
            except Exception:  # noqa: BLE001 - the listener must outlive any connection failure
                self.connected.clear()
                logger.warning(
                    "LISTEN connection lost; reconnecting in %.1fs", delay, exc_info=True
                )
                self._wake()
                time.sleep(delay)
                delay = min(delay * 2, 10.0)


listener = ReadyListener()
