"""(a) Burn-down: a backlog of ready no-op runs, drained as fast as each system can.

Every sweep point starts from an empty table: the backlog is inserted (untimed, then VACUUM
ANALYZE), the workers start, and the clock runs from the first handler start to the last
completion. `b` is the claim batch (SDK: lease batch and concurrency; store/raw: runs per
claim statement; Procrastinate: jobs in flight, it fetches one per statement; Celery: prefetch
multiplier of a solo-pool worker), `w` the worker processes. The peers' backlog is topped
back up to N between points instead (their finished jobs stay, like the project's would
between retention passes): loading 20 000 Procrastinate jobs takes longer than a quick point.
"""

from __future__ import annotations

from bench.common import log
from bench.systems import ProjectDatabase, make, measure


def points(opts) -> list[tuple[int, int]]:
    if opts.points:
        return opts.points
    # 250x4: the SDK's batches can be larger than the sweep; that is where the REST path
    # stops paying its fixed cost per request.
    if opts.quick:
        return [(1, 2), (10, 2), (100, 2), (100, 4), (250, 4)]
    return [(b, w) for w in (1, 2, 4) for b in (1, 10, 100)] + [(250, 4)]


def run(opts) -> list:
    n = opts.runs or (20_000 if opts.quick else 200_000)
    cap = opts.cap or (2.0 if opts.quick else 90.0)
    project = ProjectDatabase("burndown")
    rows = []
    for name in opts.systems:
        system = make(name, "burndown", project, opts.web_workers)
        system.setup()
        try:
            for batch, workers in points(opts):

                first = (batch, workers) == points(opts)[0]

                def load(system=system, first=first) -> None:
                    if system.peer and not first:
                        system.top_up(n)
                    else:
                        system.reset()
                        system.load(n)

                row = measure(
                    system,
                    scenario="burndown",
                    config=f"b={batch} w={workers}",
                    expected=n,
                    workers=workers,
                    batch=batch,
                    deadline_after_go=cap,
                    due_is_go=True,
                    setup_while_starting=load,
                    keep=opts.keep,
                )
                log(f"  {system.label:<20} b={batch:<3} w={workers}: {row.runs} runs, "
                    f"{(row.rate or 0):,.0f}/s {row.note}")
                rows.append(row)
        finally:
            system.teardown()
    return rows
