"""The example Celery app as a bridge deployed ahead of its Celery workers sees it: with one
task more (`demo.ahead`) that the workers, started on `examples.celery_worker.app`, do not have."""

from __future__ import annotations

from cronlease_client import Context
from cronlease_client.celery import cronlease_task

from examples.celery_worker.app import app


@cronlease_task(app, "demo.ahead")
def ahead(ctx: Context) -> dict:
    return {"ran": True}
