"""The raw-SQL ceiling of materialisation: one set-based statement per batch of due definitions.

    python -m bench.workers.raw_materialise --url URL [--batch 5000] --out DIR --go FILE

For each shard, until a batch comes back short: lock up to `batch` due definitions (SKIP
LOCKED, the partial due index), insert their runs (jitter from SHA-256 of the name, the cron
idempotency key) and move `next_due_at` one hour on — in one statement and one transaction.
No lease/epoch check, no per-definition schedule maths (every bench definition is hourly).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import connect
from bench.recorder import Recorder, wait_for_go

MATERIALISE = """
WITH due AS (
    SELECT id, name, team_id, queue, priority, shard, retry_max_attempts, dry_run, payload,
           payload_key, next_due_at
    FROM jobs_jobdefinition
    WHERE shard = %(shard)s AND NOT paused AND next_due_at IS NOT NULL
      AND next_due_at <= now() + interval '300 seconds'
    ORDER BY next_due_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), inserted AS (
    INSERT INTO runs_run (
        definition_id, team_id, queue, priority, shard, state, trigger, due_at, available_at,
        attempt, max_attempts, idempotency_key, lease_seconds, worker_id, dry_run, payload,
        payload_key, created_at
    )
    SELECT id, team_id, queue, priority, shard, 'scheduled', 'cron', next_due_at,
           next_due_at + make_interval(secs => (('x' || substr(encode(sha256(convert_to(name, 'UTF8')), 'hex'), 17, 15))::bit(60)::bigint %% 60)::int),
           0, retry_max_attempts,
           name || '@' || to_char(next_due_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"+00:00"'),
           60, '', dry_run, payload, payload_key, now()
    FROM due
    ON CONFLICT DO NOTHING
    RETURNING 1
), moved AS (
    UPDATE jobs_jobdefinition d SET next_due_at = due.next_due_at + interval '1 hour'
    FROM due WHERE d.id = due.id
    RETURNING 1
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM inserted)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--out", required=True)
    parser.add_argument("--go")
    args = parser.parse_args()
    rec = Recorder(args.out, "raw-materialise")
    conn = connect(args.url, application_name="bench:raw-materialise")
    rec.ready()
    wait_for_go(args.go)
    started = time.perf_counter()
    inserted = 0
    for shard in range(16):
        while True:
            handled, new = conn.execute(
                MATERIALISE, {"shard": shard, "batch": args.batch}
            ).fetchone()
            inserted += new
            if handled < args.batch:
                break
    seconds = time.perf_counter() - started
    Path(args.out, "result.json").write_text(json.dumps({"seconds": seconds, "runs": inserted}))
    rec.close()


if __name__ == "__main__":
    main()
