"""Create N runs (jobs) as an application would, with T threads, B per call; print one JSON line
with the count, the seconds from the first call to the last answer, and this process's CPU.

    python -m bench.workers.enqueuer rest --url URL --token T --count N --batch B --threads T
    python -m bench.workers.enqueuer {procrastinate,celery} --count N --batch B --threads T
    (either with --ready FILE --go FILE: connect, touch FILE, start at the go)

- rest: the product's API through the SDK's producer client (`Client.enqueue_many`: one
  `POST /api/v1/runs` of B items per call; B = 1 is one run per request); with --ids-only
  the answer names each run by its id (`runs=False`, `Prefer: return=minimal`); with
  --http-floor, no run at all: each "run" is one `GET /healthz` on the client's own connection,
  the cost of an HTTP request to the same web processes, which one run a request cannot beat.
- procrastinate: `defer` per job at B = 1, `batch_defer` of B jobs otherwise.
- celery: `apply_async` per task at B = 1, a Redis pipeline of B messages otherwise (what a
  producer that batches does: see bench/workers/producer.py's Submitter).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from pathlib import Path

from bench.common import JOB
from bench.recorder import wait_for_go


def rest_sender(url: str, token: str, runs: bool = True, floor: bool = False):
    from cronlease_client import Client

    local = threading.local()

    def send(batch: list[dict]) -> None:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = Client(url, token)
        if floor:
            for _ in batch:
                client._http.get("/healthz").raise_for_status()
            return
        results = client.enqueue_many(batch, runs=runs)
        refused = [result for result in results if not result.ok]
        assert not refused, refused[:3]

    def items(n: int) -> list[dict]:
        return [
            {"job": JOB, "idempotency_key": uuid.uuid4().hex, "payload": {"n": i}} for i in range(n)
        ]

    return send, items


def procrastinate_sender():
    import asyncio

    from bench.workers import peers

    local = threading.local()

    def send(batch: list[dict]) -> None:
        if getattr(local, "app", None) is None:
            local.loop = asyncio.new_event_loop()
            local.app, local.task = peers.procrastinate_app(pool_size=2)
            local.loop.run_until_complete(local.app.open_async())
        if len(batch) == 1:
            local.loop.run_until_complete(local.task.defer_async(**batch[0]))
        else:
            local.loop.run_until_complete(local.task.batch_defer_async(*batch))

    return send, lambda n: [{"due": time.time()} for _ in range(n)]


def celery_sender():
    from bench.workers.producer import Submitter

    # One submitter for every thread: making its message template pops a scratch queue, which
    # threads making their own would race for. Its Redis client is safe to share.
    submitter = Submitter("celery")

    def send(batch: list[dict]) -> None:
        if len(batch) == 1:
            submitter.task.apply_async((batch[0]["due"],))
        else:
            submitter.submit([item["due"] for item in batch])

    return send, lambda n: [{"due": time.time()} for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=["rest", "procrastinate", "celery"])
    parser.add_argument("--url")
    parser.add_argument("--token")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument(
        "--ids-only",
        action="store_true",
        help="rest: ask for the runs' ids alone (Prefer: return=minimal)",
    )
    parser.add_argument(
        "--http-floor",
        action="store_true",
        help="rest: GET /healthz instead of each run (the HTTP floor)",
    )
    parser.add_argument("--ready", help="touch this file when connected, then wait for --go")
    parser.add_argument("--go")
    args = parser.parse_args()
    if args.system == "rest":
        send, items = rest_sender(args.url, args.token, not args.ids_only, args.http_floor)
    elif args.system == "procrastinate":
        send, items = procrastinate_sender()
    else:
        send, items = celery_sender()
    calls = args.count // args.batch
    per_thread = [
        calls // args.threads + (1 if i < calls % args.threads else 0) for i in range(args.threads)
    ]
    send(items(1))  # connections, apps and templates made before the clock starts
    if args.ready:
        Path(args.ready).touch()
    wait_for_go(args.go)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for _ in range(n):
                send(items(args.batch))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in per_thread]
    cpu0, t0 = time.process_time(), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    print(
        json.dumps(
            {
                "count": calls * args.batch,
                "seconds": seconds,
                "cpu_s": time.process_time() - cpu0,
                "pid": os.getpid(),
            }
        )
    )


if __name__ == "__main__":
    main()
