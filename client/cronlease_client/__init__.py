"""cronlease worker SDK: lease runs over REST, run handlers, heartbeat, report, stop gracefully.

    from cronlease_client import Worker, handler

    @handler("billing.export-invoices")
    def export(ctx):
        ...

No Django here: this package talks to the scheduler only over HTTP.
"""

from __future__ import annotations

import logging

from cronlease_client._version import __version__
from cronlease_client.context import Context
from cronlease_client.errors import ApiError, HandlerError, NonRetryable, Retryable
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
    "Context",
    "HandlerError",
    "HandlerSpec",
    "NonRetryable",
    "Retryable",
    "Worker",
    "__version__",
    "handler",
    "load_handlers",
    "registered_handlers",
]
