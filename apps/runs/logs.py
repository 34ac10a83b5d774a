"""Events of single runs, one JSON line each (apps/ops/logs.py formats them): leased, succeeded,
failed, reaped, each with the run id and attempt, the fencing token where the worker gave one,
and the job where the statement reads its definition (a lease, a failure, a reap; a completion's
statement keeps to the run's row, so its line names the run only)."""

from __future__ import annotations

import logging

# Events of single runs, one line each: leased, succeeded, failed, reaped. At tens of thousands
# of runs a second, set this logger to WARNING and rely on the metrics.
run_log = logging.getLogger("scheduler.runs")


def runs_logged() -> bool:
    """Whether run events are written: callers skip formatting their fields when not."""
    return run_log.isEnabledFor(logging.INFO)


def run_event(message: str, *, run_id: str, **fields) -> None:
    if run_log.isEnabledFor(logging.INFO):
        # The record is made here, not by `run_log.info`, which walks the stack for the
        # caller's file and line on every call: nothing prints them, and the walk was a tenth
        # of an event's 30 µs of CPU, two events a run (bench/README.md).
        record = run_log.makeRecord(
            run_log.name,
            logging.INFO,
            __file__,
            0,
            message,
            (),
            None,
            extra={"run_id": run_id, **fields},
        )
        run_log.handle(record)
