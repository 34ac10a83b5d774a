"""(e) Soak: a steady backlog burnt down for N minutes, with an idle-in-transaction session
holding back vacuum for the middle half.

The backlog is topped up whenever it falls below half (the project: one INSERT of runs by the
parent, as the materialiser would; the peers: their producer in refill mode). Reported:
throughput per interval (a tenth of the soak, 2–10 s), drift (last two intervals / first two), throughput while the
idle transaction was open against before it, dead tuples (pg_stat_user_tables) and table and
index sizes at the start, when the idle transaction ends, and at the end. The project's REST
system soaks for the full N minutes; in --quick the other four soak 6 s each (the budget of
the whole quick run is 10 minutes).
"""

from __future__ import annotations

import time

import psycopg

from bench import common
from bench.common import Row, log
from bench.systems import ProjectDatabase, make, measure

TABLES = {
    "project": ["runs_run", "runs_attempt"],
    "procrastinate": ["procrastinate_jobs", "procrastinate_events"],
}


def interval_for(duration: float) -> float:
    return max(2.0, min(10.0, duration / 10))


def table_stats(url: str, tables: list[str]) -> dict:
    with common.connect(url) as conn:
        rows = conn.execute(
            "SELECT relname, n_live_tup, n_dead_tup, pg_relation_size(relid),"
            " pg_indexes_size(relid) FROM pg_stat_user_tables WHERE relname = ANY(%s)",
            [tables],
        ).fetchall()
    return {
        name: {
            "live": live,
            "dead": dead,
            "table_mb": round(t / 2**20, 1),
            "indexes_mb": round(i / 2**20, 1),
        }
        for name, live, dead, t, i in rows
    }


def run(opts) -> list[Row]:
    long_s = opts.seconds or (60.0 if opts.quick else 600.0)
    short_s = 6.0 if opts.quick else long_s
    backlog = 10_000 if opts.quick else 50_000
    project = ProjectDatabase("soak")
    rows: list[Row] = []
    for name in opts.systems:
        duration = long_s if name == "rest" else short_s
        system = make(name, "soak", project, opts.web_workers)
        system.setup()
        try:
            kind = (
                "procrastinate"
                if name == "procrastinate"
                else (None if name == "celery" else "project")
            )
            url = getattr(system, "pq_url", None) if kind == "procrastinate" else project.url
            stats: dict[str, dict] = {}

            def load(system=system, kind=kind, url=url, stats=stats) -> None:
                system.reset()
                system.load(backlog)
                if kind:
                    stats["start"] = table_stats(url, TABLES[kind])

            state = {
                "submitted": backlog,
                "samples": [],
                "idle": None,
                "t_go": None,
                "idle_window": None,
            }

            def tick(
                run_dir,
                now,
                handled,
                system=system,
                duration=duration,
                kind=kind,
                url=url,
                state=state,
                stats=stats,
            ):
                if state["t_go"] is None:
                    state["t_go"] = now
                    state["idle_window"] = (now + 0.25 * duration, now + 0.75 * duration)
                    state["samples"].append((now, handled))
                if not system.peer and state["submitted"] - handled < backlog // 2:
                    system.project.insert_runs(backlog // 2, time.time() - 1.0, vacuum=False)
                    state["submitted"] += backlog // 2
                if now - state["samples"][-1][0] >= interval_for(duration):
                    state["samples"].append((now, handled))
                start, end = state["idle_window"]
                if kind and state["idle"] is None and start <= now < end:
                    conn = common.connect(
                        url, autocommit=False, application_name="bench:idle-in-transaction"
                    )
                    conn.execute("SELECT txid_current()")  # holds the xmin horizon back
                    state["idle"] = conn
                    log(f"  idle-in-transaction session opened at {now - state['t_go']:.0f}s")
                if kind and state["idle"] not in (None, "closed") and now >= end:
                    state["idle"].rollback()
                    state["idle"].close()
                    state["idle"] = "closed"
                    stats["idle_end"] = table_stats(url, TABLES[kind])
                    system.monitor_commits += 1
                    log(f"  idle-in-transaction session closed at {now - state['t_go']:.0f}s")
                return False

            producer = (
                {"refill": "DIR", "backlog": backlog, "seconds": duration} if system.peer else None
            )
            row = measure(
                system,
                scenario="soak",
                config=f"{duration:.0f}s",
                expected=10**12,
                workers=opts.workers,
                batch=opts.batch,
                deadline_after_go=duration,
                cap_from_first=False,
                on_tick=tick,
                producer=producer,
                setup_while_starting=load,
                keep=opts.keep,
            )
            if isinstance(state["idle"], psycopg.Connection):
                state["idle"].close()
            row.extra.pop("_pairs", None)
            # The intervals count handler calls (the recorders); so does the last sample.
            samples = state["samples"] + [(row.extra["_t_stop"], row.extra["started"])]
            rates = [
                round((b[1] - a[1]) / (b[0] - a[0]), 1)
                for a, b in zip(samples, samples[1:], strict=False)
                if b[0] - a[0] > 1.0
            ]
            row.extra["interval_rates"] = rates
            if len(rates) >= 4 and rates[0] + rates[1]:
                row.extra["drift"] = round((rates[-2] + rates[-1]) / (rates[0] + rates[1]), 2)
            if kind:
                stats["end"] = table_stats(url, TABLES[kind])
                row.extra["tables"] = stats
                start, end = state["idle_window"]
                t0, n0 = samples[0]

                def rate_between(a: float, b: float, samples=samples) -> float | None:
                    inside = [s for s in samples if a <= s[0] <= b]
                    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1:
                        return None
                    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

                before, during = rate_between(t0, start), rate_between(start, end)
                if before and during:
                    row.extra["idle_tx_rate_ratio"] = round(during / before, 2)
            drift = row.extra.get("drift")
            dead = stats.get("end", {}).get(TABLES[kind][0], {}).get("dead") if kind else None
            row.note = (
                f"drift {drift if drift is not None else '–'}"
                + (f", idle-tx ×{row.extra.get('idle_tx_rate_ratio', '–')}" if kind else "")
                + (f", dead tuples {dead:,}" if dead is not None else "")
            )
            row.p50 = row.p99 = row.max = None
            log(f"  {system.label:<20} {row.runs} runs in {duration:.0f}s, {row.note}")
            rows.append(row)
        finally:
            system.teardown()
    return rows
