"""Handlers of the demo worker. Plain Python: workers never import Django."""

from __future__ import annotations

import logging
import random

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
    if random.random() < float(ctx.payload.get("failureRate", 0.5)):
        raise Retryable("the flaky upstream timed out")
    return {"ok": True}


@handler("demo.delayed-email")
def delayed_email(ctx) -> dict:
    logger.info("would send an email to %s", ctx.payload.get("to"))
    return {"sent": True}
