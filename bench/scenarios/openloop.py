"""(b) Open loop: runs fall due at a fixed rate whether or not the workers keep up.

Due = availableAt (the project's runs are materialised ahead with availableAt = t0 + i/rate,
as the scheduler does for cron runs; the peers get each job from a producer process at its due
time, see bench/workers/producer.py). Start = the moment the handler got it. A run not started
by the end of the window plus a drain period counts as infinitely late. Rates go up until p99
exceeds 1 s; the higher ones are then skipped. The last row per system is the highest offered
rate that kept p99 ≤ 1 s.
"""

from __future__ import annotations

import math
import time

from bench.common import Row, latency_summary, load_average, log
from bench.systems import ProjectDatabase, make, measure

TARGET_P99 = 1.0


def run(opts) -> list[Row]:
    rates = [int(x) for x in opts.rates.split(",")] if opts.rates else [500, 2000, 5000, 10000]
    duration = opts.seconds or (10.0 if opts.quick else 60.0)
    drain = 1.0 if opts.quick else 15.0
    project = ProjectDatabase("openloop")
    rows: list[Row] = []
    for name in opts.systems:
        system = make(name, "openloop", project, opts.web_workers)
        system.setup()
        best = 0
        try:
            failed_at = None
            for rate in rates:
                config = f"{rate}/s"
                if failed_at is not None:
                    rows.append(
                        Row(
                            "openloop",
                            name,
                            config,
                            load=[load_average()[0]] * 2,
                            note=f"skipped: p99 > {TARGET_P99:g}s at {failed_at}/s",
                        )
                    )
                    continue
                n = int(rate * duration)
                system.reset()
                clock = {"t0": None}

                def lagging(run_dir, now, handled, n=n, rate=rate, clock=clock):
                    # Over 1 % of the runs already more than 1 s late: p99 > 1 s is certain.
                    t0 = clock["t0"]
                    if t0 is None:
                        text = run_dir.go.read_text().strip() if run_dir.go.exists() else ""
                        t0 = clock["t0"] = float(text) if text else clock.get("fixed")
                    if t0 is None:
                        return False
                    overdue = min(n, int((now - t0 - TARGET_P99) * rate))
                    return overdue - handled > 0.01 * n + rate * 0.2

                common = dict(
                    scenario="openloop",
                    config=config,
                    expected=n,
                    workers=opts.workers,
                    batch=opts.batch,
                    cap_from_first=False,
                    on_tick=lagging,
                    keep=opts.keep,
                )
                if system.peer:
                    row = measure(
                        system,
                        producer={"count": n, "rate": rate},
                        t0_after_go=1.0,
                        deadline_after_go=1.0 + duration + drain,
                        **common,
                    )
                else:
                    # The workers are up and waiting; insert the runs so they fall due from
                    # t0 (one second after the insert ends) on.
                    def prepare(system=system, n=n, rate=rate, clock=clock):
                        t0 = time.time() + 0.7 + n / 20_000
                        system.schedule(n, t0, rate)
                        if time.time() > t0 - 0.2:
                            log(
                                f"  warning: the insert of {n} runs ended {time.time() - t0:.1f}s after t0"
                            )
                        clock["fixed"] = t0
                        return t0 + duration + drain

                    row = measure(system, deadline_after_go=1e9, prepare=prepare, **common)
                pairs = row.extra.pop("_pairs")
                values = [start - due for due, start in pairs]
                # Unstarted runs that were due before the measurement stopped: infinitely late.
                t0 = clock["t0"] or clock.get("fixed")
                due_by_stop = min(n, int((row.extra["_t_stop"] - t0) * rate) + 1)
                values += [math.inf] * max(0, due_by_stop - len(values))
                summary = latency_summary(values)
                row.p50, row.p99, row.max = summary["p50"], summary["p99"], summary["max"]
                row.runs = min(row.runs, n)
                row.seconds = duration if row.runs == n else row.seconds
                ok = row.p99 is not None and row.p99 <= TARGET_P99
                row.extra["offered"] = rate
                row.extra["p99_ok"] = ok
                early = (
                    " (stopped when over 1 % were > 1 s late)"
                    if row.note == "stopped early"
                    else ""
                )
                row.note = "p99 ≤ 1s" if ok else f"p99 > 1s; {len(pairs)}/{n} started{early}"
                log(
                    f"  {system.label:<20} {config:>8}: p50 {row.p50:.3f}s p99 {row.p99:.3f}s "
                    f"max {row.max:.3f}s ({len(pairs)}/{n} started)"
                )
                rows.append(row)
                if ok:
                    best = rate
                else:
                    failed_at = rate
        finally:
            system.teardown()
        rows.append(
            Row(
                "openloop",
                name,
                "max rate p99≤1s",
                runs=best,
                seconds=1.0 if best else 0,
                note="highest offered rate with p99 ≤ 1 s" if best else "none of the rates",
            )
        )
    return rows
