"""Where PostgreSQL's time goes, statement by statement (not part of `all`).

    python -m bench statements [--systems raw,store,rest] [--batch 100] [--workers 2]
        [--runs 40000] [--rounds 2]

A burn-down at one point per system (as `burndown` measures it), on a private cluster with
`pg_stat_statements` loaded (whatever `--server` says), each measurement from zeroed
statistics. Logged per system and round: the statements that took the most execution time,
each as calls, execution µs, shared buffers hit and WAL records per run drained; then per table
the rows inserted and updated, and how many of the updates were HOT (no index entry written).
The per-run figures compare statements across systems: the same work done by another plan or
another number of statements shows there, where a burn-down's rate drifts with the machine.
"""

from __future__ import annotations

from typing import Any

from bench import common
from bench.common import Row, log
from bench.systems import ProjectDatabase, make, measure

STATEMENTS = "-c shared_preload_libraries=pg_stat_statements"
TOP = 8

# Per statement of the project's database, most execution time first; BEGIN, COMMIT and the
# bench's own progress reads are left in (they cost the server too).
BY_STATEMENT = """
SELECT calls, total_exec_time, shared_blks_hit + shared_blks_read, wal_records,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 72)
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time DESC
LIMIT %(top)s
"""
BY_TABLE = """
SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd
FROM pg_stat_user_tables WHERE n_tup_ins + n_tup_upd > 0 ORDER BY relname
"""


def run(opts) -> list[Row]:
    n = opts.runs or 40_000
    cap = opts.cap or 60.0
    rows: list[Row] = []
    with common.private_server(STATEMENTS) as url, common.on_server(url):
        with common.connect(url) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        project = ProjectDatabase("statements")
        project.ensure()
        project.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        for round_ in range(1, opts.rounds + 1):
            for name in opts.systems:
                system = make(name, "statements", project, opts.web_workers)
                system.setup()
                try:

                    def load(system=system) -> None:
                        system.reset()
                        system.load(n)
                        project.execute("SELECT pg_stat_statements_reset()")
                        project.execute("SELECT pg_stat_reset()")

                    config = f"b={opts.batch} w={opts.workers} #{round_}"
                    row = measure(
                        system,
                        scenario="statements",
                        config=config,
                        expected=n,
                        workers=opts.workers,
                        batch=opts.batch,
                        deadline_after_go=cap,
                        due_is_go=True,
                        setup_while_starting=load,
                        keep=opts.keep,
                    )
                finally:
                    system.teardown()
                row.extra.update(round=round_, **read(project, row.runs or n))
                log(f"  {system.label:<20} {config:<14}: {row.runs} runs, {(row.rate or 0):,.0f}/s")
                log_statistics(row.extra)
                rows.append(row)
    return rows


def read(project: ProjectDatabase, runs: int) -> dict[str, Any]:
    """The statistics since `load` zeroed them, per run drained."""
    statements = [
        {
            "calls": calls,
            "exec_us": round(1000 * exec_ms / runs, 1),
            "blocks": round(blocks / runs, 1),
            "wal": round(wal / runs, 2),
            "query": query,
        }
        for calls, exec_ms, blocks, wal, query in project.execute(BY_STATEMENT, {"top": TOP})
    ]
    tables = {
        relname: {"inserted": ins, "updated": upd, "hot": hot}
        for relname, ins, upd, hot in project.execute(BY_TABLE)
    }
    return {"statements": statements, "tables": tables}


def log_statistics(extra: dict[str, Any]) -> None:
    log("      calls  exec µs  blocks   WAL  (per run drained)")
    for s in extra["statements"]:
        log(f"    {s['calls']:>7} {s['exec_us']:>8} {s['blocks']:>7} {s['wal']:>5}  {s['query']}")
    for relname, t in extra["tables"].items():
        log(f"    {relname}: {t['inserted']} inserted, {t['updated']} updated ({t['hot']} HOT)")
