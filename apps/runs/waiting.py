"""Long-poll wake-ups: one LISTEN connection per process and shard database, shared by every
waiting claim.

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

from apps.runs import shards
from apps.runs.store import READY_CHANNEL

logger = logging.getLogger(__name__)


class ReadyListener:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._generation = 0
        self._threads: dict[str, threading.Thread] = {}
        self._start_lock = threading.Lock()
        self._connected: dict[str, threading.Event] = {}
        self._stopping = threading.Event()
        # The process is stopping: long polls answer what they have instead of waiting on.
        self.closing = threading.Event()

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def connected(self) -> bool:
        """Whether every shard database's LISTEN connection is up."""
        return bool(self._connected) and all(e.is_set() for e in self._connected.values())

    def ensure_started(self) -> None:
        started = []
        with self._start_lock:
            for alias in shards.databases():
                thread = self._threads.get(alias)
                if thread is None or not thread.is_alive():
                    started.append(self._connected.setdefault(alias, threading.Event()))
                    self._threads[alias] = thread = threading.Thread(
                        target=self._run, args=(alias,), name=f"runs-ready-listener-{alias}",
                        daemon=True,
                    )  # fmt: skip
                    thread.start()
        # The first claim after start-up must not miss a NOTIFY sent while we were connecting
        # (a database that is down is waited for this long, once; its thread keeps trying).
        deadline = time.monotonic() + 5
        for event in started:
            event.wait(timeout=max(0.0, deadline - time.monotonic()))

    def stop(self, timeout: float = 5) -> None:
        """Stop listening and close the connections (tests, and processes that exit cleanly)."""
        self._stopping.set()
        for thread in self._threads.values():
            thread.join(timeout)
        self._threads.clear()
        self._stopping.clear()
        for event in self._connected.values():
            event.clear()

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

    def close_waits(self) -> None:
        """End every long poll's wait, now and from now on: the process is stopping, and
        uvicorn stops only once every request has been answered (a deploy waited out each
        worker's `waitSeconds`)."""
        self.closing.set()
        self._wake()

    def _wake(self) -> None:
        with self._condition:
            self._generation += 1
            self._condition.notify_all()

    def _conninfo(self, alias: str) -> dict:
        settings = connections[alias].settings_dict
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

    def _run(self, alias: str) -> None:
        delay = 0.5
        connected = self._connected[alias]
        while not self._stopping.is_set():
            try:
                with psycopg.connect(**self._conninfo(alias)) as conn:
                    conn.execute(f"LISTEN {READY_CHANNEL}")
                    connected.set()
                    delay = 0.5
                    # Anything may have happened while we were not listening.
                    self._wake()
                    while not self._stopping.is_set():
                        for _ in conn.notifies(timeout=1):
                            self._wake()
            except Exception:  # noqa: BLE001 - the listener must outlive any connection failure
                connected.clear()
                logger.warning(
                    "LISTEN connection to %s lost; reconnecting in %.1fs",
                    alias,
                    delay,
                    exc_info=True,
                )
                self._wake()
                time.sleep(delay)
                delay = min(delay * 2, 10.0)


listener = ReadyListener()
