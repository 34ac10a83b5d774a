"""The example Celery app: Redis as the broker, the cronlease tasks in tasks.py.

    export CRONLEASE_URL=http://127.0.0.1:8000 CRONLEASE_TOKEN=…      # a worker-scope token
    celery -A examples.celery_worker.app worker --pool=solo --loglevel=INFO
    python -m cronlease_client bridge examples.celery_worker.app --queue celery-demo

The broker is `CELERY_BROKER_URL` (default redis://127.0.0.1:6379/0). The tasks reach the
scheduler at CRONLEASE_URL with CRONLEASE_TOKEN (or `app.conf.cronlease_url` and
`app.conf.cronlease_token`).
"""

from __future__ import annotations

import logging
import os

from celery import Celery, signals

app = Celery(
    "celery_worker_example",
    broker=os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0"),
    include=["examples.celery_worker.tasks"],
)
app.conf.update(
    # As few messages held back as Celery allows: one per slot besides those running (each is
    # acknowledged when its task starts). A message a busy worker holds is a lease the bridge
    # extends for nothing, until the worker falls silent if it dies.
    worker_prefetch_multiplier=1,
    # Acknowledged on receipt (the cronlease tasks insist on it): the scheduler's lease expiry,
    # not a broker redelivery, recovers the runs of a Celery worker that died.
    task_acks_late=False,
    broker_connection_retry_on_startup=True,
)


@signals.after_setup_logger.connect
def quiet_http_logs(**kwargs: object) -> None:
    """httpx logs every request at INFO: a line per heartbeat is noise in a worker's log."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
