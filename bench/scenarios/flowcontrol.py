"""(i) Flow control: an unlimited job's burn-down beside a limited job's backlog of 100 000.

The same queue holds N ready runs of `bench.noop` (no limit; quick 20 000, full 200 000) and,
ahead of them (an hour older), a backlog of another job that no claim may take:

- **alone**: nothing else;
- **rate-limited**: 100 000 runs of a job whose rate window is spent (1 per hour, used);
- **hot key**: 100 000 runs of one concurrency key whose one slot is held (`concurrencyPerKey`
  1, a run of that key leased to a worker that never reports);
- **1 000 keys**: 100 000 runs over 1 000 keys, each key's slot held: every claim visits keys
  that all turn out full (the visit's worst case).

The claim of `bench.noop`'s runs should not see the others (bench/README.md, "Flow control"):
each row's note gives its runs/s against the `alone` row of its system. Systems: the store layer
and REST+SDK (`--systems`), `--batch` per claim, `--workers` processes.
"""

from __future__ import annotations

from bench.common import JOB, log
from bench.systems import ProjectDatabase, make, measure

SYSTEMS = ("store", "rest")
BACKLOG = 100_000
LIMITED_JOB = "bench.limited"

# A copy of bench.noop's definition under another name, id and limits, on the same shard (a
# definition's id names its shard, as a run's does: apps/runs/shards.py).
COPY_DEFINITION = """
INSERT INTO jobs_jobdefinition ({columns})
SELECT {values} FROM jobs_jobdefinition WHERE name = %(job)s
"""
# The held backlog: ready an hour ago (the head of the queue), `limited` as the product's
# inserts set it for a definition with a limit; keys `k0000`… when keyed.
INSERT_HELD = """
INSERT INTO runs_run (
    id, definition_id, team_id, queue, priority, shard, state, trigger, due_at, available_at,
    attempt, max_attempts, idempotency_key, concurrency_key, lease_seconds, worker_id, dry_run,
    payload, payload_key, created_at{limited}
)
SELECT nextval('runs_run_id_seq') * 1024 + d.shard, d.id, d.team_id, d.queue, d.priority,
       d.shard, 'ready', 'api', now() - interval '1 hour',
       now() - interval '1 hour' + g * interval '1 microsecond', 0, 3, 'held-' || g,
       CASE WHEN %(keys)s > 0 THEN 'k' || lpad((g %% %(keys)s)::text, 4, '0') END,
       60, '', false, d.payload, d.payload_key, now(){flag}
FROM jobs_jobdefinition d CROSS JOIN generate_series(1, %(n)s) AS g
WHERE d.name = %(job)s
"""
# Each key's one slot, held by a leased run that nobody will finish within the measurement.
HOLD_KEYS = """
UPDATE runs_run SET state = 'leased', attempt = 1, worker_id = 'stuck', fencing_token = id,
       lease_expires_at = now() + interval '1 day', timeout_at = now() + interval '1 day',
       started_at = now()
WHERE id IN (SELECT DISTINCT ON (concurrency_key) id FROM runs_run
             WHERE definition_id = (SELECT id FROM jobs_jobdefinition WHERE name = %(job)s)
             ORDER BY concurrency_key, id)
"""
# The rate window spent: one start within the hour allowed one.
SPEND_RATE = """
INSERT INTO runs_ratestart (definition_id, started_at)
SELECT id, now() FROM jobs_jobdefinition WHERE name = %(job)s
"""
LIMITS = {
    "rate-limited": {"rate_limit_count": "1", "rate_limit_period_seconds": "3600"},
    "hot key": {"concurrency_per_key": "1"},
    "1 000 keys": {"concurrency_per_key": "1"},
}
KEYS = {"hot key": 1, "1 000 keys": 1000}


def limited_definition(project: ProjectDatabase, case: str) -> None:
    """`bench.limited`, with the case's limits, replacing the previous case's."""
    project.execute("DELETE FROM jobs_jobdefinition WHERE name = %s", [LIMITED_JOB])
    columns = [
        row[0]
        for row in project.execute(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_name = 'jobs_jobdefinition' ORDER BY ordinal_position"
        )
    ]
    overrides = {"id": "id + 1024", "name": "%(limited)s", "next_due_at": "NULL", **LIMITS[case]}
    project.execute(
        COPY_DEFINITION.format(
            columns=", ".join(columns),
            values=", ".join(overrides.get(column, column) for column in columns),
        ),
        {"job": JOB, "limited": LIMITED_JOB},
    )


def held_insert(project: ProjectDatabase) -> str:
    """INSERT_HELD, marking the runs `limited` where the schema has the column (it can then be
    run against commits from before it, for comparison)."""
    marked = project.execute(
        "SELECT 1 FROM information_schema.columns"
        " WHERE table_name = 'runs_run' AND column_name = 'limited'"
    )
    return INSERT_HELD.format(
        limited=", limited" if marked else "", flag=", true" if marked else ""
    )


def run(opts) -> list:
    n = opts.runs or (20_000 if opts.quick else 200_000)
    cap = opts.cap or (15.0 if opts.quick else 90.0)
    project = ProjectDatabase("flowcontrol")
    rows = []
    for name in [s for s in opts.systems if s in SYSTEMS] or list(SYSTEMS):
        system = make(name, "flowcontrol", project, opts.web_workers)
        system.setup()
        try:
            alone = None
            for case in ("alone", *LIMITS):

                def load(system=system, case=case) -> None:
                    system.reset()
                    project.execute("TRUNCATE runs_ratestart")
                    if case != "alone":
                        limited_definition(project, case)
                        params = {"job": LIMITED_JOB, "n": BACKLOG, "keys": KEYS.get(case, 0)}
                        project.execute(held_insert(project), params)
                        if case in KEYS:
                            project.execute(HOLD_KEYS, params)
                        else:
                            project.execute(SPEND_RATE, params)
                    system.load(n)

                row = measure(
                    system,
                    scenario="flowcontrol",
                    config=f"{case} b={opts.batch} w={opts.workers}",
                    expected=n,
                    workers=opts.workers,
                    batch=opts.batch,
                    deadline_after_go=cap,
                    due_is_go=True,
                    setup_while_starting=load,
                    keep=opts.keep,
                )
                rate = row.rate or 0.0
                if case == "alone":
                    alone = rate
                elif alone:
                    row.note = (row.note + f" {rate / alone:.2f}× alone").strip()
                log(f"  {system.label:<20} {case:<13}: {row.runs} runs, {rate:,.0f}/s {row.note}")
                rows.append(row)
        finally:
            system.teardown()
    return rows
