"""Materialisation by a peer's own scheduler: K schedule entries all due now, deferred/sent.

    python -m bench.workers.peer_periodic procrastinate --count K --cap S --out DIR --go FILE
    python -m bench.workers.peer_periodic celery --count K --cap S --out DIR --go FILE

Procrastinate: K `@app.periodic(cron="* * * * *", periodic_id=i)` registrations; its
PeriodicDeferrer's catch-up pass (what a worker runs at start) defers the previous minute's
job of each, one `procrastinate_defer_periodic_job` call (one transaction) per entry.
Celery: K beat entries (every hour, last run an hour ago, so all due) in beat's in-memory
Scheduler, ticked as `celery beat` does; each tick sends one due entry (apply_async).
Writes {"seconds", "runs"} to DIR/result.json; stops at the cap.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from datetime import timedelta
from pathlib import Path

from bench.recorder import Recorder, wait_for_go
from bench.workers import peers


def procrastinate(count: int, cap: float, rec: Recorder, go: str) -> tuple[float, int]:
    from procrastinate.periodic import PeriodicDeferrer

    app, _ = peers.procrastinate_app(pool_size=2)

    @app.task(name="bench.periodic", queue="bench-periodic")
    async def periodic(timestamp: int) -> None:
        return None

    for i in range(count):
        app.periodic(cron="* * * * *", periodic_id=str(i))(periodic)

    async def main() -> tuple[float, int]:
        async with app.open_async():
            deferrer = PeriodicDeferrer(registry=app.periodic_registry, max_delay=600)
            rec.ready()
            wait_for_go(go)
            started = time.perf_counter()
            pending = deferrer.get_previous_tasks(at=time.time())
            done = 0
            while time.perf_counter() - started < cap:
                chunk = list(itertools.islice(pending, 200))
                if not chunk:
                    break
                await deferrer.defer_jobs(chunk)
                done += len(chunk)
            return time.perf_counter() - started, done

    return asyncio.run(main())


def celery(count: int, cap: float, rec: Recorder, go: str) -> tuple[float, int]:
    from celery.beat import Scheduler

    app, _ = peers.celery_app()
    an_hour_ago = app.now() - timedelta(hours=1, seconds=1)
    app.conf.beat_schedule = {
        f"bench-{i}": {
            "task": "bench.noop",
            "schedule": timedelta(hours=1),
            "args": (0.0,),
            "last_run_at": an_hour_ago,
        }
        for i in range(count)
    }

    class Counting(Scheduler):
        sent = 0

        def apply_async(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            result = super().apply_async(*args, **kwargs)
            Counting.sent += 1
            return result

    scheduler = Counting(app=app, lazy=False)
    rec.ready()
    wait_for_go(go)
    started = time.perf_counter()
    while Counting.sent < count and time.perf_counter() - started < cap:
        scheduler.tick()
    return time.perf_counter() - started, Counting.sent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=["procrastinate", "celery"])
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--cap", type=float, default=15)
    parser.add_argument("--out", required=True)
    parser.add_argument("--go")
    args = parser.parse_args()
    rec = Recorder(args.out, f"{args.system}-periodic")
    run = procrastinate if args.system == "procrastinate" else celery
    seconds, done = run(args.count, args.cap, rec, args.go)
    Path(args.out, "result.json").write_text(json.dumps({"seconds": seconds, "runs": done}))
    rec.close()


if __name__ == "__main__":
    main()
