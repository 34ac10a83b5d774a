"""The raw-SQL ceiling: claim N and complete N per statement with psycopg, no Django.

    python -m bench.workers.raw_worker --url URL --batch 100 --out DIR [--go FILE] [--runs-only]

Same table, same indexes and the same rows written as the product (the run leased with a
fencing token from `runs_fencing_token`, an attempt row inserted; on completion the run
succeeded and the attempt ended), but none of its features: one lane (the bench team's queue
and priority, known in advance), no fairness pass, no concurrency limits, no payload decoding,
no metrics. Autocommit: one statement is one transaction. `--runs-only` leaves the attempts
table out (the floor of what any design that keeps runs in this table pays).
"""

from __future__ import annotations

import argparse
import os
import time

WAITING = "('scheduled', 'ready', 'retrying')"

# The claim's candidates and their lease, up to the RETURNING list's end (`returning` adds
# columns): shared with bench/workers/http_ceiling.py.
CLAIMED = f"""
WITH c AS (
    -- `NOT limited` as the product's claim of runs without limits: the claim index (run_claimable)
    -- has it after the lane, before the time. Without it, since that column came (migration
    -- runs/0017), this read every waiting run of the lane and sorted them: the ceiling fell below
    -- the store layer (9 780 against 17 437 runs/s at b=100 w=2, 2026-12-02).
    SELECT id FROM runs_run
    WHERE team_id = %(team)s AND queue = %(queue)s AND priority = %(priority)s
      AND NOT limited AND state IN {WAITING} AND available_at <= now()
    ORDER BY available_at, id
    LIMIT %(n)s
    FOR UPDATE SKIP LOCKED
), leased AS (
    UPDATE runs_run r
    SET state = 'leased', attempt = r.attempt + 1, fencing_token = nextval('runs_fencing_token'),
        worker_id = %(worker)s, lease_seconds = 300,
        timeout_at = now() + interval '1 hour', lease_expires_at = now() + interval '300 seconds',
        started_at = coalesce(r.started_at, now()),
        late_seconds = coalesce(r.late_seconds, extract(epoch FROM now() - r.available_at))
    FROM c WHERE r.id = c.id
    RETURNING r.id, r.attempt, r.fencing_token, r.available_at{{returning}}
)"""
CLAIM = (
    CLAIMED.format(returning="")
    + """{attempts}
SELECT id, fencing_token, extract(epoch FROM available_at)::float8 FROM leased
"""
)

INSERT_ATTEMPTS = """, attempts AS (
    INSERT INTO runs_attempt (run_id, number, fencing_token, worker_id, leased_at, outcome,
                              error_message, error_type)
    SELECT id, attempt, fencing_token, %(worker)s, now(), '', '', '' FROM leased
)"""

# The completion of the runs in `i` (id, token) whose lease the token still holds: shared with
# bench/workers/http_ceiling.py.
DONE = """, done AS (
    UPDATE runs_run r
    SET state = 'succeeded', result = NULL, finished_at = now(), lease_expires_at = NULL
    FROM i WHERE r.id = i.id AND r.state = 'leased' AND r.fencing_token = i.token
    RETURNING r.id, r.attempt
)"""
COMPLETE = (
    """
WITH i AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS i(id, token)
)"""
    + DONE
    + """{attempts}
SELECT count(*) FROM done
"""
)

END_ATTEMPTS = """, ended AS (
    UPDATE runs_attempt a SET ended_at = now(), outcome = 'succeeded'
    FROM done WHERE a.run_id = done.id AND a.number = done.attempt
)"""

NEXT = f"""
SELECT extract(epoch FROM min(available_at))::float8 FROM runs_run
WHERE team_id = %(team)s AND queue = %(queue)s AND priority = %(priority)s AND NOT limited
  AND state IN {WAITING}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--out", required=True)
    parser.add_argument("--go")
    parser.add_argument("--runs-only", action="store_true")
    args = parser.parse_args()

    from bench.common import JOB, QUEUE, connect
    from bench.recorder import Recorder, wait_for_go

    claim = CLAIM.format(attempts="" if args.runs_only else INSERT_ATTEMPTS)
    complete = COMPLETE.format(attempts="" if args.runs_only else END_ATTEMPTS)
    conn = connect(args.url, application_name="bench:raw")
    team, priority = conn.execute(
        "SELECT team_id, priority FROM jobs_jobdefinition WHERE name = %s", [JOB]
    ).fetchone()
    lane = {"team": team, "queue": QUEUE, "priority": priority}
    params = {**lane, "n": args.batch, "worker": f"bench-raw/{os.getpid()}"}
    rec = Recorder(args.out, "raw")
    rec.ready()
    wait_for_go(args.go)
    while True:
        rows = conn.execute(claim, params, prepare=True).fetchall()
        if not rows:
            upcoming = conn.execute(NEXT, lane, prepare=True).fetchone()[0]
            pause = 0.5 if upcoming is None else upcoming - time.time()
            time.sleep(min(0.5, max(0.001, pause)))
            continue
        for _, _, due in rows:
            rec.hit(due)
        conn.execute(
            complete,
            {"ids": [row[0] for row in rows], "tokens": [row[1] for row in rows]},
            prepare=True,
        )


if __name__ == "__main__":
    main()
