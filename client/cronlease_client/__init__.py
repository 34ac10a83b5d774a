"""cronlease SDK: workers lease runs over REST, run handlers, heartbeat, report, stop gracefully;
producers create runs and manage jobs with `Client` / `AsyncClient`.

    from cronlease_client import Worker, handler

    @handler("billing.export-invoices")
    def export(ctx):
        ...

    from cronlease_client import Client

    with Client(url, token) as client:
        client.enqueue("billing.export-invoices", payload={"format": "csv"}, delay=60)

No Django here: this package talks to the scheduler only over HTTP.
"""

from __future__ import annotations

import logging

from cronlease_client._version import __version__
from cronlease_client.client import AsyncClient, Client
from cronlease_client.context import Context
from cronlease_client.errors import (
    ApiError,
    BadAnswer,
    BadRequest,
    ChangedMeanwhile,
    Conflict,
    Forbidden,
    HandlerError,
    IdempotencyConflict,
    LeaseLost,
    NetworkError,
    NonRetryable,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    Retryable,
    RunCancelled,
    ServerError,
    SyncIncomplete,
    Unauthorized,
    Unavailable,
)
from cronlease_client.models import (
    Attempt,
    DlqResult,
    Enqueue,
    EnqueueResult,
    FireTime,
    Job,
    Page,
    Queue,
    RateLimit,
    Run,
    SyncChange,
    SyncResult,
)
from cronlease_client.registry import (
    HandlerSpec,
    handler,
    load_handlers,
    registered_handlers,
)
from cronlease_client.worker import SHUTDOWN_ERROR, Worker

# A library stays quiet until the application configures logging.
logging.getLogger("cronlease_client").addHandler(logging.NullHandler())

__all__ = [
    "SHUTDOWN_ERROR",
    "ApiError",
    "AsyncClient",
    "Attempt",
    "BadAnswer",
    "BadRequest",
    "Client",
    "ChangedMeanwhile",
    "Conflict",
    "Context",
    "DlqResult",
    "Enqueue",
    "EnqueueResult",
    "FireTime",
    "Forbidden",
    "HandlerError",
    "HandlerSpec",
    "IdempotencyConflict",
    "Job",
    "LeaseLost",
    "NetworkError",
    "NonRetryable",
    "NotFound",
    "Page",
    "PayloadTooLarge",
    "Queue",
    "RateLimit",
    "RateLimited",
    "Retryable",
    "Run",
    "RunCancelled",
    "ServerError",
    "SyncIncomplete",
    "SyncChange",
    "SyncResult",
    "Unauthorized",
    "Unavailable",
    "Worker",
    "__version__",
    "handler",
    "load_handlers",
    "registered_handlers",
]
