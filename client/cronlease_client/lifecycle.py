"""What the worker and the Celery bridge share: threads, signals, the graceful stop, heartbeats.

Both lease runs of their queues in a loop and heartbeat what they hold from a thread of their
own. SIGTERM and SIGINT (or `stop()`) only set `shutdown`; the loops see it, and a supervisor
thread runs the subclass's `_shut_down()` (a grace period, then what is left) and sets `_stopped`,
which `run()` waits for. A second SIGINT (or `stop(force=True)`) sets `forced`: no grace period.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Self

from cronlease_client.errors import ApiError
from cronlease_client.reporting import MAX_BATCH
from cronlease_client.transport import Refusal, Transport, backoff_delay, heartbeat_leases

logger = logging.getLogger("cronlease_client")


def default_worker_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}"


class Daemon:
    """A process that leases runs of `queues` in background threads and stops gracefully.

    Subclasses define `start()` (spawning their threads with `_spawn`, the supervisor with
    `_supervise`), `heartbeat_once()` (one round of the heartbeat thread) and `_shut_down()`.
    """

    kind = "daemon"  # in log lines: "worker", "bridge"
    # Whether run() returns as soon as a forced stop is asked for rather than when the
    # supervisor is done: the worker's still has the pool processes to end, the bridge's nothing.
    returns_when_forced = False
    # Made by start(): the lease loop's connection and the heartbeat thread's.
    _lease_http: Transport
    _heartbeat_http: Transport

    def __init__(
        self,
        base_url: str,
        token: str,
        queues: Iterable[str] | str,
        *,
        lease_seconds: int,
        wait_seconds: int,
        worker_id: str | None,
        grace_seconds: float,
        heartbeat_interval: float,
        http_timeout: float,
    ) -> None:
        self.queues = [queues] if isinstance(queues, str) else list(queues)
        if not self.queues:
            raise ValueError("give at least one queue")
        self.base_url = base_url
        self.token = token
        self.lease_seconds = lease_seconds
        self.wait_seconds = wait_seconds
        self.worker_id = worker_id or default_worker_id()
        self.grace_seconds = grace_seconds
        self.heartbeat_interval = heartbeat_interval
        self.http_timeout = http_timeout
        # Set by a fatal answer (401, 403, 400) to a lease request, or by a crash of the
        # lease loop; run() raises it, so the process exits non-zero and a supervisor restarts it.
        self.error: Exception | None = None

        self.shutdown = threading.Event()
        self._forced = threading.Event()
        self._stopped = threading.Event()
        self._threads_stop = threading.Event()  # ends the heartbeats (and the bridge's events)
        self._lease_done = threading.Event()
        # Guards the subclass's state; notified on every change to it.
        self._lock = threading.Condition()
        self._threads: dict[str, threading.Thread] = {}
        self._started = False

    @property
    def stopping(self) -> bool:
        return self.shutdown.is_set()

    @property
    def forced(self) -> bool:
        """Whether it was told to exit at once (a second Ctrl-C, or stop(force=True))."""
        return self._forced.is_set()

    def start(self) -> Self:
        raise NotImplementedError

    def run(self) -> None:
        """Start and block until stopped; raise ApiError when the scheduler refused this process.

        In the main thread, SIGTERM and SIGINT stop it gracefully and a second SIGINT makes it
        exit at once.
        """
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, self._on_signal)
        try:
            self.start()
            # Short waits so the main thread gets back to the interpreter to run signal handlers.
            while not self._stopped.wait(0.2):
                if self.returns_when_forced and self._forced.is_set():
                    break
        finally:
            for signum, handler in previous.items():
                # None: a handler installed outside Python, which cannot be put back.
                if handler is not None:
                    signal.signal(signum, handler)
        if self.error is not None:
            raise self.error

    def stop(self, *, force: bool = False, timeout: float | None = None) -> bool:
        """Stop leasing, give the runs under way the grace period, and wait for the end.

        `force=True` skips the grace period (the leases expire on the server). Return whether it
        has stopped within `timeout` (default: the grace period plus 30 s).
        """
        if force:
            self._forced.set()
        self.shutdown.set()
        with self._lock:
            self._lock.notify_all()
        if not self._started:
            self._stopped.set()
            return True
        return self.join(self.grace_seconds + 30 if timeout is None else timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until it has stopped; return whether it has."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self.shutdown.is_set():
            self._forced.set()
        self.shutdown.set()

    def _wait_for_drain(self, busy: Callable[[], bool]) -> None:
        """Wait, holding `_lock`, until the lease loop has ended and `busy()` is false, the grace
        period is over, or a second signal forces the stop."""
        deadline = time.monotonic() + self.grace_seconds
        while not self._forced.is_set() and (busy() or not self._lease_done.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._lock.wait(min(left, 0.1))

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        # Daemon threads: a handler stuck past the grace period must not keep the process alive.
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads[name] = thread
        thread.start()

    def _transport(self, *, cancel: threading.Event, attempts: int = 5) -> Transport:
        return Transport(
            self.base_url, self.token, timeout=self.http_timeout, attempts=attempts, cancel=cancel
        )

    def _fail_fatally(self, exc: ApiError) -> None:
        # 401/403/400 will not get better by asking again: stop, and let run() raise it.
        self.error = exc
        logger.error("the scheduler refused this %s (%s); stopping", self.kind, exc)
        self.shutdown.set()

    def _lease_failed(self, exc: ApiError, failures: int) -> bool:
        """After the `failures`-th lease request in a row failed: stop for good on an answer
        that asking again will not change (False), else wait out a capped backoff (True)."""
        if not exc.transient:
            self._fail_fatally(exc)
            return False
        delay = backoff_delay(failures, base=0.5, cap=30.0)
        # The scheduler's Retry-After (429, 503) is at least what it asked, here as in the
        # transport's own tries; the round's backoff alone sent one 0.4 s after a 3 s ask.
        asked = getattr(exc, "retry_after", None)
        if asked:
            delay = max(delay, min(asked, 300.0))
        logger.warning("leasing failed; retrying in %.1fs: %s", delay, exc)
        self.shutdown.wait(delay)
        return True

    # -- heartbeats -------------------------------------------------------------------------

    def heartbeat_once(self) -> None:
        raise NotImplementedError

    def _heartbeat_loop(self) -> None:
        while not self._threads_stop.wait(self.heartbeat_interval):
            try:
                self.heartbeat_once()
            except Exception:
                logger.exception("heartbeat round failed")
        self._heartbeat_http.close()

    def _extend(self, leases: list[tuple[str, int]]) -> dict[str, Refusal]:
        """Heartbeat (run id, fencing token) pairs; return the refused ones by run id."""
        return heartbeat_leases(
            self._heartbeat_http,
            leases,
            timeout=max(1.0, min(self.http_timeout, self.heartbeat_interval)),
            batch=MAX_BATCH,
        )

    # -- shutdown ---------------------------------------------------------------------------

    def _shut_down(self) -> None:
        raise NotImplementedError

    def _supervise(self) -> None:
        self.shutdown.wait()
        try:
            self._shut_down()
        except Exception:
            logger.exception("shutdown failed")
        finally:
            self._stopped.set()
