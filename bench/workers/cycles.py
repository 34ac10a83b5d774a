"""Lease 100, report 100, in-process: the worker API's own cost per run, to count instructions.

    DATABASE_URL=… BENCH_TOKEN=… LOG_RUNS_LEVEL=WARNING PYTHONHASHSEED=0 \\
        valgrind --tool=lackey --basic-counts=yes python -m bench.workers.cycles 3 40

Inserts 100 × (warm-up + cycles) claimable runs of `bench.noop`, then runs `warm-up + cycles`
cycles of `POST /api/v1/leases` (max 100) and `POST /api/v1/results` through Django's test
client: the whole request path (middleware, dispatch, validation, store, rendering) without
sockets. Timings on this machine drift by a fifth from one run to the next; the instruction count
valgrind reports does not. Two runs that differ only in `cycles` give the instructions of one
cycle by difference (start-up cancels): see bench/README.md, "The worker API's shapes".
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    warm_up, cycles = int(sys.argv[1]), int(sys.argv[2])
    import django

    django.setup()
    from django.test import Client

    from bench.systems import ProjectDatabase

    project = ProjectDatabase("cycles")
    project.url, project.token = os.environ["DATABASE_URL"], os.environ["BENCH_TOKEN"]
    project.reset()
    project.insert_runs(100 * (warm_up + cycles), time.time() - 1)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {project.token}")
    lease = {"queues": ["bench"], "max": 100, "workerId": "w-1", "leaseSeconds": 60}
    for _ in range(warm_up + cycles):
        leases = client.post("/api/v1/leases", lease, content_type="application/json").json()
        results = [
            {"runId": one["runId"], "fencingToken": one["fencingToken"], "outcome": "succeeded"}
            for one in leases["leases"]
        ]
        assert len(results) == 100, "the backlog ran out"
        answer = client.post(
            "/api/v1/results", {"results": results}, content_type="application/json"
        )
        assert answer.status_code == 200, answer.content


if __name__ == "__main__":
    main()
