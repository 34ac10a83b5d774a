"""Two cronlease jobs as Celery tasks: one that succeeds, one whose upstream is always down.

Every call is written to a small SQLite ledger (`CELERY_EXAMPLE_DB`, default
`celery_example.sqlite3`), which the tests read to see what ran, with which key and token.
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing
from typing import Any

from cronlease_client.celery import CeleryContext, cronlease_task

from examples.celery_worker.app import app

SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY,
    job TEXT NOT NULL,
    run_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    idempotency_key TEXT NOT NULL,
    fencing_token INTEGER NOT NULL,
    hostname TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS invoices (
    idempotency_key TEXT PRIMARY KEY,
    fencing_token INTEGER NOT NULL
);
"""


def ledger() -> sqlite3.Connection:
    db = sqlite3.connect(os.environ.get("CELERY_EXAMPLE_DB", "celery_example.sqlite3"), timeout=30)
    db.executescript(SCHEMA)
    return db


def log_call(ctx: CeleryContext) -> None:
    with closing(ledger()) as db, db:
        db.execute(
            "INSERT INTO calls (job, run_id, attempt, idempotency_key, fencing_token, hostname) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                ctx.job,
                ctx.run_id,
                ctx.attempt,
                ctx.idempotency_key,
                ctx.fencing_token,
                ctx.task.request.hostname or "",
            ),
        )


@cronlease_task(app, "billing.send-invoice")
def send_invoice(ctx: CeleryContext) -> dict[str, Any]:
    """Send the run's invoice once, whatever the retries; `workSeconds` in the payload to dawdle."""
    log_call(ctx)
    deadline = time.monotonic() + float((ctx.payload or {}).get("workSeconds", 0))
    while time.monotonic() < deadline:
        # Waiting on the flag rather than sleeping: a lost lease ends the work at once, and a
        # cancel within a tenth of a second (the outcome is still reported: it ends cancelled).
        if ctx.lease_lost.wait(0.1):
            return {"sent": False}
        if ctx.cancelled:
            return {"sent": False, "cancelled": True}
    with closing(ledger()) as db, db:
        # Keyed by the idempotency key (the same on every attempt) and fenced by the token (it
        # grows with every lease): a retry does not send twice, a superseded attempt not at all.
        sent = db.execute(
            "INSERT INTO invoices (idempotency_key, fencing_token) VALUES (?, ?) "
            "ON CONFLICT (idempotency_key) DO NOTHING",
            (ctx.idempotency_key, ctx.fencing_token),
        ).rowcount
    return {"sent": bool(sent), "invoice": ctx.idempotency_key}


@cronlease_task(app, "reports.flaky-upstream", bind=True)
def flaky_upstream(self, ctx: CeleryContext) -> None:
    """Ask Celery to retry, as existing Celery code does: the scheduler retries it instead."""
    log_call(ctx)
    try:
        raise ConnectionError(f"upstream unavailable (attempt {ctx.attempt})")
    except ConnectionError as exc:
        # Fails this attempt as retryable; the definition's maxAttempts and backoff decide what
        # follows, and no second Celery message is published.
        raise self.retry(exc=exc, countdown=5) from exc
