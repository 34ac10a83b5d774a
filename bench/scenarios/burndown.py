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

import statistics

from bench.common import Row, log
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
    """Each system's whole sweep in turn, set up and torn down around it; `--rounds R` repeats
    that R times. With more than one round each row's config names its round, the table's
    ratios are read within it, and each system's median ×raw over the rounds is logged: this
    machine's speed drifts by a third between minutes (bench/README.md, the dated sections),
    and one run's ratios moved as much as a change did."""
    n = opts.runs or (20_000 if opts.quick else 200_000)
    cap = opts.cap or (2.0 if opts.quick else 90.0)
    project = ProjectDatabase("burndown")
    rows = []
    loaded: set[str] = set()
    for round_ in range(1, opts.rounds + 1):
        for name in opts.systems:
            system = make(name, "burndown", project, opts.web_workers)
            system.setup()
            try:
                for batch, workers in points(opts):
                    config = f"b={batch} w={workers}" + (f" #{round_}" if opts.rounds > 1 else "")

                    def load(system=system) -> None:
                        if system.peer and system.name in loaded:
                            system.top_up(n)
                        else:
                            system.reset()
                            system.load(n)
                        loaded.add(system.name)

                    row = measure(
                        system,
                        scenario="burndown",
                        config=config,
                        expected=n,
                        workers=workers,
                        batch=batch,
                        deadline_after_go=cap,
                        due_is_go=True,
                        setup_while_starting=load,
                        keep=opts.keep,
                    )
                    row.extra["round"] = round_
                    log(
                        f"  {system.label:<20} {config:<14}: {row.runs} runs, "
                        f"{(row.rate or 0):,.0f}/s {row.note}"
                    )
                    rows.append(row)
            finally:
                system.teardown()
    if opts.rounds > 1:
        log_rounds(rows)
    return rows


def log_rounds(rows: list[Row]) -> None:
    """Each system's ×raw at each point, round by round, and the median."""
    rates = {
        (row.system, row.config.rsplit(" #", 1)[0], row.extra["round"]): row.rate for row in rows
    }
    rounds = range(1, 1 + max(round_ for _, _, round_ in rates))
    for system, config in dict.fromkeys((s, c) for s, c, _ in rates if s != "raw"):
        ratios = [
            mine / raw
            for r in rounds
            if (mine := rates.get((system, config, r))) and (raw := rates.get(("raw", config, r)))
        ]
        if ratios:
            log(
                f"  {system:<14} {config:<10} ×raw per round "
                + ", ".join(f"{x:.2f}" for x in ratios)
                + f" (median {statistics.median(ratios):.2f})"
            )
