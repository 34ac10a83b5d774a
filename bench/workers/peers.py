"""The two peers, configured once: a Procrastinate app and a Celery app with the no-op task.

Both read their connection from the environment (BENCH_PQ_URL, BENCH_REDIS_URL and
BENCH_CELERY_QUEUE), so worker, producer and parent build the same apps. The task records
(due, start) in the process's Recorder, like the product's SDK handler.
"""

from __future__ import annotations

import os

from bench.common import QUEUE, REDIS_URL
from bench.recorder import Recorder

RECORDER: Recorder | None = None


def procrastinate_app(pool_size: int = 4):
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=os.environ["BENCH_PQ_URL"],
            min_size=1,
            max_size=pool_size,
            kwargs={"application_name": "bench:procrastinate"},
        )
    )

    @app.task(name="bench.noop", queue=QUEUE)
    async def noop(due: float) -> None:
        RECORDER.hit(due)

    return app, noop


def celery_app(prefetch: int = 4):
    from celery import Celery

    app = Celery("bench", broker=os.environ.get("BENCH_REDIS_URL", REDIS_URL))
    app.conf.update(
        task_ignore_result=True,
        task_default_queue=os.environ.get("BENCH_CELERY_QUEUE", "bench"),
        worker_prefetch_multiplier=prefetch,
        task_acks_late=False,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        worker_disable_rate_limits=True,
    )

    @app.task(name="bench.noop")
    def noop(due: float) -> None:
        RECORDER.hit(due)

    return app, noop
