"""One peer worker process: Procrastinate or Celery, with the no-op task.

    python -m bench.workers.peer_worker procrastinate --batch 100 --out DIR [--go FILE]
    python -m bench.workers.peer_worker celery --batch 100 --out DIR [--go FILE]

Procrastinate: `app.run_worker(concurrency=batch)`; it fetches one job per statement (there is
no batch fetch), `batch` is how many it runs at once; its pool gets min(batch, 4) + 1
connections. Celery: a `--pool solo` worker (consume and execute in one process, no IPC: the
fastest Celery pool for no-op tasks) with `worker_prefetch_multiplier = batch`, acks on receipt
(Celery's default), no result backend, no gossip/mingle/heartbeat.
"""

from __future__ import annotations

import argparse
import logging
import os

from bench.recorder import Recorder, wait_for_go
from bench.workers import peers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=["procrastinate", "celery"])
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--out", required=True)
    parser.add_argument("--go")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    peers.RECORDER = rec = Recorder(args.out, args.system)
    if args.system == "procrastinate":
        app, _ = peers.procrastinate_app(pool_size=min(args.batch, 4) + 1)
        rec.ready()
        wait_for_go(args.go)
        app.run_worker(
            queues=["bench"],
            concurrency=args.batch,
            wait=True,
            listen_notify=True,
            delete_jobs="never",
            name=f"bench-{os.getpid()}",
        )
    else:
        from celery import signals

        app, _ = peers.celery_app(prefetch=args.batch)

        @signals.worker_ready.connect
        def hold_until_go(**_: object) -> None:
            # Celery takes seconds to boot; the go waits until it is connected and consuming
            # (the event loop that fetches messages has not turned yet).
            rec.ready()
            wait_for_go(args.go)

        app.worker_main(
            [
                "worker",
                "--pool",
                "solo",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "WARNING",
                "--queues",
                app.conf.task_default_queue,
                "--hostname",
                f"bench{os.getpid()}@localhost",
            ]
        )


if __name__ == "__main__":
    main()
