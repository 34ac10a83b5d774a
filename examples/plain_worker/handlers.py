"""Example handlers for a plain (non-Celery) worker.

    CRONLEASE_URL=http://127.0.0.1:8000 CRONLEASE_TOKEN=… \
        python -m cronlease_client run examples.plain_worker.handlers --queue plain

Their effects go to a small SQLite ledger (`PLAIN_WORKER_DB`, default `plain_worker.sqlite3`),
which the tests read to check what ran, with which key and token.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import closing
from typing import Any

from cronlease_client import Context, NonRetryable, handler

SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    idempotency_key TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    run_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    fencing_token INTEGER NOT NULL,
    detail TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS fences (
    idempotency_key TEXT PRIMARY KEY,
    fencing_token INTEGER NOT NULL
);
"""


def ledger_path() -> str:
    return os.environ.get("PLAIN_WORKER_DB", "plain_worker.sqlite3")


def record_once(ctx: Context, detail: dict[str, Any]) -> bool:
    """Record this run's effect exactly once; return whether this attempt recorded it.

    Delivery is at least once, so the same run may reach a handler twice: a retry after a worker
    died between writing and reporting, or a "zombie" attempt that kept running after its lease
    was lost while a newer attempt got the run. Two guards, in one transaction with the effect:
    1. The fence: the highest fencing token seen for this idempotency key. Tokens only grow, so an
       attempt whose token is below it has been superseded; it must write nothing, or it could
       undo the newer attempt's work. (This is the storage-side check that makes fencing tokens
       work: the store refuses the stale writer, whatever the writer believes.)
    2. The effect row is keyed by the idempotency key, which every attempt of a run shares: when
       an earlier attempt already wrote it, a retry finds the row and does not apply it again.
    """
    with closing(sqlite3.connect(ledger_path(), timeout=30)) as db:
        db.executescript(SCHEMA)
        with db:  # one transaction: the fence moves only together with the effect
            fenced = db.execute(
                "INSERT INTO fences (idempotency_key, fencing_token) VALUES (?, ?) "
                "ON CONFLICT (idempotency_key) DO UPDATE SET fencing_token = excluded.fencing_token "
                "WHERE excluded.fencing_token >= fences.fencing_token",
                (ctx.idempotency_key, ctx.fencing_token),
            )
            if fenced.rowcount == 0:
                ctx.logger.warning("superseded by a newer attempt; not writing")
                return False
            written = db.execute(
                "INSERT INTO effects (idempotency_key, job, run_id, attempt, fencing_token, detail) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (idempotency_key) DO NOTHING",
                (
                    ctx.idempotency_key,
                    ctx.job,
                    ctx.run_id,
                    ctx.attempt,
                    ctx.fencing_token,
                    json.dumps(detail, sort_keys=True),
                ),
            )
            return written.rowcount == 1


@handler("billing.record-charge", dry_run=True)
def record_charge(ctx: Context) -> dict[str, Any]:
    """Charge `amountCents` to `customer`, once per run whatever the retries."""
    payload = ctx.payload or {}
    customer, amount = payload.get("customer"), payload.get("amountCents")
    if not isinstance(customer, str) or not isinstance(amount, int):
        # A bad payload stays bad on every attempt: straight to the dead-letter queue.
        raise NonRetryable("payload needs customer (string) and amountCents (integer)")
    if ctx.dry_run:
        # Opted in to dry runs (dry_run=True above): say what would happen, change nothing.
        return {"wouldCharge": {"customer": customer, "amountCents": amount}}
    charged = record_once(ctx, {"customer": customer, "amountCents": amount})
    return {"charged": charged, "customer": customer, "amountCents": amount}


@handler("demo.sleep")
def sleep(ctx: Context) -> dict[str, Any]:
    """Work for `seconds` (default 1), then record the effect; give up early if the lease is lost."""
    seconds = float((ctx.payload or {}).get("seconds", 1))
    # Waiting on the flag rather than sleeping: a lost lease ends the work at once.
    if ctx.lease_lost.wait(seconds):
        ctx.logger.info("lease lost after starting; stopping without writing")
        return {"slept": False}
    return {"slept": seconds, "recorded": record_once(ctx, {"slept": seconds})}


@handler("demo.steps")
def steps(ctx: Context) -> dict[str, Any]:
    """Work in `steps` steps (default 10) of `stepSeconds` (default 0.5), checking in with
    `ctx.heartbeat()` between them: a cancel from the dashboard or the API raises RunCancelled
    there once the worker's heartbeats (every third of its lease) have learned of it, and the
    run ends cancelled instead of running to the end."""
    payload = ctx.payload or {}
    count, pause = int(payload.get("steps", 10)), float(payload.get("stepSeconds", 0.5))
    for _ in range(count):
        ctx.heartbeat()
        time.sleep(pause)
    return {"steps": count}


@handler("demo.flaky")
def flaky(ctx: Context) -> dict[str, Any]:
    """Fail the first `failAttempts` attempts (default 1) with a retryable error, then succeed."""
    fail_attempts = int((ctx.payload or {}).get("failAttempts", 1))
    if ctx.attempt <= fail_attempts:
        raise ConnectionError(f"upstream unavailable on attempt {ctx.attempt}")
    return {"attempt": ctx.attempt}
