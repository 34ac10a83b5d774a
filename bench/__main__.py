"""Benchmarks: this project (REST + SDK, store layer, raw-SQL ceiling) side by side with
Procrastinate and Celery + Redis. See bench/README.md.

    python -m bench all --quick
    python -m bench burndown|openloop|burst|materialise|soak|dashboard|enqueue|shards|flowcontrol
        [--quick] [options]
    python -m bench profile      (py-spy of the store layer and the web process, EXPLAIN plans)
    python -m bench statements   (pg_stat_statements per system: execution, buffers, WAL a run)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time

from bench import common, report
from bench.systems import DEFAULT_SYSTEMS, SYSTEMS

SCENARIOS = (
    "burndown",
    "openloop",
    "burst",
    "materialise",
    "soak",
    "dashboard",
    "enqueue",
    "shards",
    "flowcontrol",
)


def parse_points(text: str) -> list[tuple[int, int]]:
    """`1x2,100x4` -> [(batch 1, workers 2), (batch 100, workers 4)]."""
    out = []
    for item in text.split(","):
        batch, workers = item.lower().split("x")
        out.append((int(batch), int(workers)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("scenario", choices=("all", *SCENARIOS, "profile", "statements"))
    parser.add_argument(
        "--quick", action="store_true", help="the small sizes (under 10 minutes for all)"
    )
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help="comma-separated, of " + ",".join(SYSTEMS),
    )
    parser.add_argument(
        "--web-workers", type=int, default=2, help="manage.py web --workers (default 2)"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes outside the sweep (default 2)"
    )
    parser.add_argument(
        "--batch", type=int, default=100, help="claim batch outside the sweep (default 100)"
    )
    parser.add_argument(
        "--points", type=parse_points, help="burn-down sweep as BATCHxWORKERS,… (e.g. 1x2,100x4)"
    )
    parser.add_argument("--runs", type=int, help="override the scenario's run count")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="enqueue, burndown, statements: measure the systems in turn this many times (medians, ratios per round)",
    )
    parser.add_argument("--cap", type=float, help="override the per-measurement time cap (s)")
    parser.add_argument(
        "--rates", help="open loop: comma-separated rates (default 500,2000,5000,10000)"
    )
    parser.add_argument("--seconds", type=float, help="open loop / soak: seconds per measurement")
    parser.add_argument("--definitions", type=int, help="materialise: definitions")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directories")
    parser.add_argument(
        "--server",
        choices=("machine", "private"),
        default="machine",
        help="machine: BENCH_PG_URL (default); private: a cluster of the "
        "bench's own with PostgreSQL's defaults (autovacuum on)",
    )
    opts = parser.parse_args()
    opts.systems = [s for s in opts.systems.split(",") if s]
    unknown = set(opts.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}")

    with contextlib.ExitStack() as stack:
        if opts.server == "private":
            common.PG_URL = stack.enter_context(common.private_server())
        run(opts)


def run(opts: argparse.Namespace) -> None:
    chosen = SCENARIOS if opts.scenario == "all" else (opts.scenario,)
    machine = common.server_facts()
    started = time.time()
    common.log(
        f"bench {opts.scenario} ({'quick' if opts.quick else 'full'}): {machine}, "
        f"load average {common.load_average()}"
    )
    if opts.scenario == "profile":
        importlib.import_module("bench.scenarios.profile").run(opts)
        return
    rows = []
    for name in chosen:
        common.log(f"scenario {name}")
        t = time.time()
        module = importlib.import_module(f"bench.scenarios.{name}")
        rows.extend(module.run(opts))
        common.log(f"scenario {name} done in {time.time() - t:.0f}s")
    elapsed = time.time() - started
    text = report.table(rows)
    print()
    print(text)
    print(
        f"\n{opts.scenario} ({'quick' if opts.quick else 'full'}) took {elapsed:.0f}s; "
        f"load average now {common.load_average()}"
    )
    path = common.save_results(
        f"{opts.scenario}{'-quick' if opts.quick else ''}",
        {
            "scenario": opts.scenario,
            "quick": opts.quick,
            "machine": machine,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "seconds": round(elapsed, 1),
            "options": {k: v for k, v in vars(opts).items()},
            "rows": [report.clean(row) for row in rows],
            "table": text,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
