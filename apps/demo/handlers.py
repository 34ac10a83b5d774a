"""Handlers of the demo worker. Plain Python: workers never import Django."""

from __future__ import annotations

import hashlib
import logging

from cronlease_client import Retryable, handler

logger = logging.getLogger("demo.worker")


@handler("demo.nightly-report")
def nightly_report(ctx) -> dict:
    logger.info(
        "nightly report %s (key %s, token %s)", ctx.run_id, ctx.idempotency_key, ctx.fencing_token
    )
    return {"rows": 42, "format": ctx.payload.get("format")}


@handler("demo.every-minute")
def every_minute(ctx) -> dict:
    logger.info("%s says %s", ctx.idempotency_key, ctx.payload.get("greeting"))
    return {"ok": True}


@handler("demo.flaky")
def flaky(ctx) -> dict:
    # Whether a run is doomed is decided by its idempotency key, so a doomed run fails every
    # attempt and reaches the dead-letter queue, while the others fail once and then succeed.
    doomed = ctx.payload.get("alwaysFail") or _fraction(ctx.idempotency_key) < float(
        ctx.payload.get("failureRate", 0.5)
    )
    if doomed or ctx.attempt == 1:
        raise Retryable("the flaky upstream timed out")
    return {"ok": True, "attempt": ctx.attempt}


def _fraction(key: str) -> float:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


@handler("demo.delayed-email")
def delayed_email(ctx) -> dict:
    logger.info("would send an email to %s", ctx.payload.get("to"))
    return {"sent": True}


@handler("demo.partner-sync")
def partner_sync(ctx) -> dict:
    logger.info("synced with the partner (run %s, due %s)", ctx.run_id, ctx.idempotency_key)
    return {"synced": True}
