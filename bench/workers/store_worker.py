"""One store-layer worker process: `apps.runs.store.claim` + `complete` in a loop, no HTTP.

    python -m bench.workers.store_worker --batch 100 --out DIR [--go FILE] [--leasing]
        (DATABASE_URL set)

What the lease and results endpoints do minus DRF, JSON and HTTP: claim up to `--batch` runs
in one transaction, run the (no-op) handlers, complete them all in one transaction. When
nothing is claimable it sleeps until the next run's availableAt (store.next_available_at, the
same alarm the long poll uses), at most 0.5 s.

`--leasing` claims as the lease endpoint does, through apps/runs/leasing.py: from every shard
database (SCHEDULER_SHARD_DATABASES), one transaction each; the completions are grouped by
database by the store itself. Nothing claimable: it sleeps 50 ms (a burn-down's end).
"""

from __future__ import annotations

import argparse
import os
import time

import django


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--out", required=True)
    parser.add_argument("--go")
    parser.add_argument("--leasing", action="store_true")
    args = parser.parse_args()

    django.setup()
    from apps.runs import store
    from apps.teams.models import Team
    from bench.common import QUEUE
    from bench.recorder import Recorder, wait_for_go

    team_ids = [Team.objects.get(slug="bench").pk]
    worker_id = f"bench-store/{os.getpid()}"
    rec = Recorder(args.out, "store")
    rec.ready()
    wait_for_go(args.go)
    if args.leasing:
        from apps.runs import leasing

        request = leasing.LeaseRequest(
            team_id=team_ids[0],
            team_ids=team_ids,
            queues=[QUEUE],
            jobs=None,
            max_runs=args.batch,
            worker_id=worker_id,
            lease_seconds=300,
            wait_seconds=0,
        )
    while True:
        if args.leasing:
            # The answer is built (here: the list copied) before every database's claim commits.
            leases = leasing.claim_or_wait(request, list)
            if not leases:
                time.sleep(0.05)
                continue
        else:
            leases = store.claim(
                queues=[QUEUE],
                max_runs=args.batch,
                worker_id=worker_id,
                lease_seconds=300,
                team_ids=team_ids,
            )
        if not leases:
            upcoming = store.next_available_at([QUEUE], team_ids)
            pause = 0.5 if upcoming is None else upcoming.timestamp() - time.time()
            time.sleep(min(0.5, max(0.001, pause)))
            continue
        for lease in leases:
            rec.hit(lease.available_at.timestamp())
        store.complete(
            [(lease.id, lease.fencing_token, None) for lease in leases], team_ids=team_ids
        )


if __name__ == "__main__":
    main()
