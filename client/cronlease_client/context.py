"""What a handler is given: the run it works on, and a flag that says the lease is gone."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, Self


class LeaseFlag(Protocol):
    """A threading.Event-like flag (a manager proxy in the process pool)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


def parse_instant(value: str | None) -> datetime | None:
    """Read the API's ISO 8601 instants (`2026-03-15T01:02:30Z`) as aware datetimes."""
    if not value:
        return None
    return _instant(value)


# A batch's leases mostly share their due and expiry instants: each distinct one is parsed once.
@functools.lru_cache(maxsize=1024)
def _instant(value: str) -> datetime:
    return datetime.fromisoformat(value)


@dataclass
class Context:
    """One attempt of one run, as the handler sees it.

    Exactly-once effects are the handler's job: key them on `idempotency_key` (the same on every
    attempt) and refuse writes from an attempt whose `fencing_token` is older than one already
    seen. `lease_lost` is set when the scheduler has given the run to someone else (or the worker
    is shutting down past its grace period); a handler that sees it should stop, since its result
    will not be sent. `cancelled` turns true when someone cancels the run while it runs (the
    scheduler says so in answer to the worker's heartbeat); the handler should stop: whatever it
    reports, the run ends cancelled. `heartbeat()` is the checkpoint that raises for either.
    """

    run_id: str
    job: str
    attempt: int
    idempotency_key: str
    fencing_token: int
    payload: Any
    due_at: datetime | None
    dry_run: bool
    lease_lost: LeaseFlag
    queue: str = ""
    priority: str = ""
    max_attempts: int = 0
    lease_expires_at: datetime | None = None
    worker_id: str = ""
    # None: retry on an ordinary exception. False: a failure of this attempt is final.
    retryable: bool | None = None
    # Set by the worker when a heartbeat answers that the run was cancelled.
    cancel_flag: LeaseFlag | None = None
    _logger: logging.LoggerAdapter[logging.Logger] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def cancelled(self) -> bool:
        """Someone cancelled the run while it runs: stop (it ends cancelled)."""
        return self.cancel_flag is not None and self.cancel_flag.is_set()

    def heartbeat(self) -> None:
        """A checkpoint for long handlers: raise `RunCancelled` once the run was cancelled, or
        `LeaseLost` once the lease is gone. The worker sends the heartbeats themselves, every
        third of the lease; this only reads what their answers said."""
        from cronlease_client.errors import LeaseLost, RunCancelled

        if self.cancelled:
            raise RunCancelled()
        if self.lease_lost.is_set():
            raise LeaseLost()

    @property
    def logger(self) -> logging.LoggerAdapter[logging.Logger]:
        """`cronlease_client.jobs.<job>`, with the run's ids on every record (made on first
        use: most handlers never log, and a worker builds thousands of contexts a second)."""
        if self._logger is None:
            self._logger = logging.LoggerAdapter(
                logging.getLogger(f"cronlease_client.jobs.{self.job}"),
                {
                    "run_id": self.run_id,
                    "job": self.job,
                    "attempt": self.attempt,
                    "fencing_token": self.fencing_token,
                },
            )
        return self._logger

    @classmethod
    def from_lease(
        cls,
        lease: Mapping[str, Any],
        *,
        lease_lost: LeaseFlag,
        worker_id: str = "",
        cancel_flag: LeaseFlag | None = None,
    ) -> Self:
        """Build the context of one lease object of `POST /api/v1/leases`."""
        return cls(
            run_id=lease["runId"],
            job=lease["job"],
            attempt=lease["attempt"],
            idempotency_key=lease["idempotencyKey"],
            fencing_token=lease["fencingToken"],
            payload=lease.get("payload"),
            due_at=parse_instant(lease.get("dueAt")),
            dry_run=bool(lease.get("dryRun", False)),
            lease_lost=lease_lost,
            queue=lease.get("queue", ""),
            priority=lease.get("priority", ""),
            max_attempts=lease.get("maxAttempts", 0),
            lease_expires_at=parse_instant(lease.get("leaseExpiresAt")),
            worker_id=worker_id,
            cancel_flag=cancel_flag,
        )
