"""(c) Cron burst: N runs due in the same second; how long until all have started.

The project's runs are inserted beforehand with one availableAt (as N cron definitions with
the same schedule and no jitter would be materialised); workers are running and waiting. The
peers get all N from a producer at that second (one `batch_defer` per 5 000 jobs for
Procrastinate, one Redis pipeline for Celery). runs/s = N / (last start - due).
"""

from __future__ import annotations

import time

from bench.common import Row, latency_summary, log
from bench.systems import ProjectDatabase, make, measure


def run(opts) -> list[Row]:
    n = opts.runs or (10_000 if opts.quick else 100_000)
    cap = opts.cap or (8.0 if opts.quick else 120.0)
    project = ProjectDatabase("burst")
    rows: list[Row] = []
    for name in opts.systems:
        system = make(name, "burst", project, opts.web_workers)
        system.setup()
        try:
            system.reset()
            common = dict(
                scenario="burst",
                config=f"{n} due at once",
                expected=n,
                workers=opts.workers,
                batch=opts.batch,
                cap_from_first=False,
                keep=opts.keep,
            )
            if system.peer:
                row = measure(
                    system,
                    producer={"count": n, "burst": True},
                    t0_after_go=1.0,
                    deadline_after_go=1.0 + cap,
                    **common,
                )
                due = row.extra["_t_go"] + 1.0
            else:
                when = {}

                def prepare(system=system, when=when):
                    when["due"] = time.time() + 1.0 + n / 12_000
                    system.schedule(n, when["due"], 1e12)
                    return when["due"] + cap

                row = measure(system, deadline_after_go=1e9, prepare=prepare, **common)
                due = when["due"]
            pairs = row.extra.pop("_pairs")
            starts = [start for _, start in pairs]
            summary = latency_summary(start - due for start in starts)
            row.p50, row.p99, row.max = summary["p50"], summary["p99"], summary["max"]
            all_started = len(starts) >= n
            row.seconds = (max(starts) - due) if all_started else cap
            row.runs = len(starts) if all_started else len(starts)
            row.extra["all_started_after_s"] = round(max(starts) - due, 3) if all_started else None
            row.note = "all started" if all_started else f"{len(starts)}/{n} started in {cap:.0f}s"
            log(f"  {system.label:<20} {row.note}; last start {row.max or 0:.2f}s after due")
            rows.append(row)
        finally:
            system.teardown()
    return rows
