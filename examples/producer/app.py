"""A producer: an application that creates runs for its own events, here a shop's orders.

Each order gets a receipt a little after it is placed: a delayed run of `shop.send-receipt`,
keyed by the order, so placing (or retrying) the same order twice sends one receipt.

    # the worker, in one terminal (a token with the worker scope)
    CRONLEASE_URL=http://127.0.0.1:8000 CRONLEASE_TOKEN=… \
        python -m cronlease_client run examples.producer.handlers --queue shop
    # the producer, in another (a token with the manage scope)
    CRONLEASE_URL=http://127.0.0.1:8000 CRONLEASE_TOKEN=… \
        python -m examples.producer.app --orders 3 --delay 5

The producer declares its job (jobs as code), enqueues one receipt per order in one request,
then follows the runs until they have succeeded; it exits 0 when every one did.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from cronlease_client import Client, Enqueue, EnqueueResult, Run

RECEIPT = "shop.send-receipt"
JOBS = [
    {
        "name": RECEIPT,
        "schedule": {},  # no schedule: its runs come from the application
        "queue": "shop",
        "timeoutSeconds": 60,
        "retry": {"maxAttempts": 5, "baseSeconds": 10, "maxSeconds": 300},
    }
]
FINISHED = {"succeeded", "dead", "cancelled"}


def declare_jobs(client: Client) -> None:
    """Create or update the application's jobs (the team's others are left alone)."""
    client.apply_jobs(JOBS)


def receipt(order: int, email: str, *, delay: float) -> Enqueue:
    return Enqueue(
        RECEIPT,
        payload={"order": order, "email": email},
        delay=delay,
        idempotency_key=f"order-{order}",
    )


def place_orders(client: Client, orders: dict[int, str], *, delay: float) -> list[Run]:
    """Enqueue a receipt for each order (id → email); return their runs."""
    results: list[EnqueueResult] = client.enqueue_many(
        [receipt(order, email, delay=delay) for order, email in orders.items()]
    )
    refused = [result.error for result in results if result.error is not None]
    if refused:
        raise refused[0]
    return [result.run for result in results if result.run is not None]


def follow(client: Client, runs: list[Run], *, timeout: float) -> list[Run]:
    """Poll the runs until each has finished (or `timeout` seconds pass); return them."""
    deadline = time.monotonic() + timeout
    latest = {run.run_id: run for run in runs}
    while True:
        pending = [run_id for run_id, run in latest.items() if run.state not in FINISHED]
        if not pending or time.monotonic() > deadline:
            return list(latest.values())
        time.sleep(0.5)
        for run_id in pending:
            latest[run_id] = client.get_run(run_id)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("CRONLEASE_URL"))
    parser.add_argument("--token", default=os.environ.get("CRONLEASE_TOKEN"))
    parser.add_argument("--orders", type=int, default=3, help="how many orders to place")
    parser.add_argument("--first-order", type=int, default=1000)
    parser.add_argument("--delay", type=float, default=5, help="seconds before each receipt")
    parser.add_argument("--timeout", type=float, default=60, help="seconds to wait for them")
    args = parser.parse_args(argv)
    if not args.url or not args.token:
        parser.error("give --url and --token (or CRONLEASE_URL and CRONLEASE_TOKEN)")

    orders = {
        order: f"customer-{order}@example.com"
        for order in range(args.first_order, args.first_order + args.orders)
    }
    with Client(args.url, args.token) as client:
        declare_jobs(client)
        runs = place_orders(client, orders, delay=args.delay)
        for run in runs:
            print(f"{run.run_id} {run.idempotency_key} due {run.available_at:%H:%M:%S}")
        finished = follow(client, runs, timeout=args.delay + args.timeout)
    for run in finished:
        print(f"{run.run_id} {run.state} {run.result}")
    return 0 if all(run.state == "succeeded" for run in finished) else 1


if __name__ == "__main__":
    sys.exit(main())
