"""Handlers that the fault scenarios run in real worker processes (no Django import here).

    python -m cronlease_client run tests.faults.handlers --queue q

- `faults.work` works for `seconds` (its first attempt for `firstAttemptSeconds` when the payload
  has it, so a test can make exactly the first lease long), gives up at once when its lease is
  lost, then records its effect once in the example ledger (`PLAIN_WORKER_DB`), keyed by the
  idempotency key and fenced by the fencing token. Its result names the token it ran with.
  The same handler serves every name in WORK_JOBS, for scenarios with several definitions.
- `faults.poison` kills its worker process, every time it runs.
"""

from __future__ import annotations

import os
from typing import Any

from cronlease_client import Context, handler

from examples.plain_worker.handlers import record_once


@handler("faults.work")
def work(ctx: Context) -> dict[str, Any]:
    payload = ctx.payload or {}
    seconds = float(payload.get("seconds", 0.2))
    if ctx.attempt == 1 and "firstAttemptSeconds" in payload:
        seconds = float(payload["firstAttemptSeconds"])
    if ctx.lease_lost.wait(seconds):
        return {"slept": False, "token": ctx.fencing_token}
    recorded = record_once(ctx, {"seconds": seconds})
    return {"recorded": recorded, "token": ctx.fencing_token}


@handler("faults.poison")
def poison(ctx: Context) -> None:
    # Not an exception the SDK could report: the process is gone before anyone hears of it.
    os._exit(1)


WORK_JOBS = ("faults.work", "faults.spent", "faults.limited", "faults.control")
HANDLERS = {name: work for name in WORK_JOBS}
