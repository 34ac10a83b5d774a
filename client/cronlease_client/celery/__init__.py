"""The Celery bridge: lease runs for a team's Celery tasks, send them to Celery, report outcomes.

    # myapp/tasks.py
    from celery import Celery
    from cronlease_client.celery import cronlease_task

    app = Celery("myapp", broker="redis://127.0.0.1:6379/0")

    @cronlease_task(app, "billing.export-invoices")
    def export_invoices(ctx):          # ctx: as the SDK's handlers get it, plus ctx.task
        return {"rows": 1234}

    python -m cronlease_client bridge myapp.tasks --queue billing   # leases, sends to Celery
    celery -A myapp.tasks worker                                     # runs the tasks

Needs `pip install "cronlease-client[celery]"`; the rest of the SDK never imports this package,
so plain workers do not need Celery.

One bookkeeping, the scheduler's. Celery only carries the message:
- The bridge (`bridge.py`) leases runs of the jobs that have a task and publishes one message per
  lease (the lease fields, fencing token included, travel in the message). It does not run
  anything.
- The task (`tasks.py`), in the Celery worker, first heartbeats with the message's fencing token.
  A 409 or 404 means the run was reaped or leased again while the message waited: the function
  must not run, the newer attempt owns the run. Otherwise it runs the function while a thread
  heartbeats, then completes the run or fails it (type, message, retryable) itself.
- Retries are the scheduler's only: `self.retry()` and the autoretry options never publish a new
  Celery message; a retry request is a retryable failure, and the definition's `maxAttempts` and
  backoff decide, with a new lease and a new fencing token per attempt.
- Messages are acknowledged on receipt (never `acks_late`): a Celery worker that dies mid-task
  loses the message, its heartbeats stop, the lease expires and the reaper retries the run. With
  late acks the broker would redeliver it as well, and two systems would retry the same run.
"""

from __future__ import annotations

from cronlease_client.celery.bridge import Bridge, BridgeFailed, PublishFailed
from cronlease_client.celery.tasks import (
    CELERY_RETRY_OPTIONS,
    HANDOFF_EVENT,
    HANDOFF_ROUTING_KEY,
    BridgeConfigError,
    CeleryContext,
    CeleryRetryRequested,
    TaskSpec,
    credentials,
    cronlease_task,
    execute,
    load_tasks,
    registered_tasks,
)

__all__ = [
    "CELERY_RETRY_OPTIONS",
    "HANDOFF_EVENT",
    "HANDOFF_ROUTING_KEY",
    "Bridge",
    "BridgeConfigError",
    "BridgeFailed",
    "CeleryContext",
    "CeleryRetryRequested",
    "PublishFailed",
    "TaskSpec",
    "credentials",
    "cronlease_task",
    "execute",
    "load_tasks",
    "registered_tasks",
]
