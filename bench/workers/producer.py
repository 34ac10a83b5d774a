"""Submit no-op jobs to a peer (Procrastinate or Celery) at a fixed rate, all at once, or to
keep a backlog topped up.

    python -m bench.workers.producer {procrastinate,celery} --count N --rate R --go FILE
    python -m bench.workers.producer {procrastinate,celery} --count N --burst --go FILE
    python -m bench.workers.producer {procrastinate,celery} --count N --load
    python -m bench.workers.producer {procrastinate,celery} --refill DIR --backlog B --seconds S --go FILE

Job i is due at t0 + i / rate, where t0 is the epoch time written in the go file; every 5 ms
the producer submits what is due by then in one call (Procrastinate: one `batch_defer`, one
INSERT; Celery: one Redis pipeline of the messages `apply_async` would publish, see Submitter). Each job carries its due
time, so a producer that falls behind shows up as latency (no coordinated omission).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import time
import uuid
from pathlib import Path

from bench.common import REDIS_URL
from bench.recorder import read_progress, wait_for_go
from bench.workers import peers

TICK = 0.005
CHUNK = 5000


def read_t0(go: str) -> float:
    wait_for_go(go)
    text = Path(go).read_text().strip()
    return float(text) if text else time.time()


class Submitter:
    """Procrastinate: `batch_defer` (one INSERT per call). Celery: the exact message that
    `apply_async` publishes (captured once), copied with fresh ids and LPUSHed through a Redis
    pipeline: `apply_async` costs ~1–2.5 ms of Python per message here (redis-py builds a
    pipeline per call), which would make the producer, not Celery's workers, the bottleneck.
    The project's runs are inserted by one SQL statement for the same reason."""

    def __init__(self, system: str) -> None:
        self.system = system
        if system == "procrastinate":
            self.loop = asyncio.new_event_loop()
            self.app, self.task = peers.procrastinate_app(pool_size=2)
            self.loop.run_until_complete(self.app.open_async())
        else:
            import redis

            self.app, self.task = peers.celery_app()
            self.queue = self.app.conf.task_default_queue
            self.redis = redis.Redis.from_url(os.environ.get("BENCH_REDIS_URL", REDIS_URL))
            scratch = f"{self.queue}.template"
            self.task.apply_async((0.0,), queue=scratch)
            self.template = json.loads(self.redis.rpop(scratch))
            self.redis.delete(scratch)

    def _celery_message(self, due: float) -> str:
        message = self.template
        task_id = str(uuid.uuid4())
        headers = dict(message["headers"], id=task_id, root_id=task_id, argsrepr=repr((due,)))
        body = [[due], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
        properties = dict(
            message["properties"],
            correlation_id=task_id,
            delivery_tag=str(uuid.uuid4()),
            delivery_info={"exchange": "", "routing_key": self.queue},
        )
        return json.dumps(
            dict(
                message,
                body=base64.b64encode(json.dumps(body).encode()).decode(),
                headers=headers,
                properties=properties,
            )
        )

    def submit(self, dues: list[float]) -> None:
        for start in range(0, len(dues), CHUNK):
            chunk = dues[start : start + CHUNK]
            if self.system == "procrastinate":
                self.loop.run_until_complete(
                    self.task.batch_defer_async(*({"due": due} for due in chunk))
                )
            else:
                pipe = self.redis.pipeline(transaction=False)
                for due in chunk:
                    pipe.lpush(self.queue, self._celery_message(due))
                pipe.execute()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=["procrastinate", "celery"])
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0)
    parser.add_argument("--burst", action="store_true")
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--refill")
    parser.add_argument("--backlog", type=int, default=20000)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--go")
    parser.add_argument("--ready")
    args = parser.parse_args()

    sub = Submitter(args.system)
    if args.ready:
        Path(args.ready).touch()
    if args.load:
        now = time.time()
        sub.submit([now] * args.count)
        return
    t0 = read_t0(args.go)
    if args.burst:
        time.sleep(max(0.0, t0 - time.time()))
        sub.submit([t0] * args.count)
        return
    if args.refill:
        submitted = 0
        end = t0 + args.seconds
        while time.time() < end:
            handled, _ = read_progress(args.refill)
            missing = args.backlog - (submitted - handled)
            if missing >= args.backlog // 4:
                now = time.time()
                sub.submit([now] * missing)
                submitted += missing
            time.sleep(0.05)
        return
    sent = 0
    while sent < args.count:
        due_now = min(args.count, int((time.time() - t0) * args.rate) + 1)
        if due_now > sent:
            sub.submit([t0 + i / args.rate for i in range(sent, due_now)])
            sent = due_now
        else:
            time.sleep(TICK)


if __name__ == "__main__":
    main()
