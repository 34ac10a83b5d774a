"""One SDK worker process (cronlease_client.Worker) with a no-op handler.

    python -m bench.workers.sdk_worker --url URL --token TOKEN --batch 100 --out DIR [--go FILE]
        [--jobs-per-shard K]

`--batch` is both the worker's concurrency (handler slots) and its lease batch size, as
`python -m cronlease_client run … --concurrency N` does by default. The handler serves
`bench.noop`, and with `--jobs-per-shard` the jobs of bench/common.py `job_names` too.
"""

from __future__ import annotations

import argparse
import logging

from cronlease_client import Worker

from bench.common import JOB, QUEUE, job_names
from bench.recorder import Recorder, wait_for_go


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--wait-seconds", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--go")
    parser.add_argument("--jobs-per-shard", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    rec = Recorder(args.out, "sdk")

    def noop(ctx) -> None:
        rec.hit(ctx.due_at.timestamp() if ctx.due_at else None)

    worker = Worker(
        args.url,
        args.token,
        [QUEUE],
        handlers=dict.fromkeys([JOB, *job_names(args.jobs_per_shard)], noop),
        concurrency=args.batch,
        batch_size=args.batch,
        lease_seconds=300,
        wait_seconds=args.wait_seconds,
        grace_seconds=1,
    )
    rec.ready()
    wait_for_go(args.go)
    try:
        worker.run()
    finally:
        rec.close()


if __name__ == "__main__":
    main()
