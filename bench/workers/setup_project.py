"""Create the benchmark's job definitions (queue `bench`, no schedule) with the ORM.

    DATABASE_URL=… python -m bench.workers.setup_project [--jobs-per-shard K]

`bench.noop`, and with `--jobs-per-shard` K more on every shard (bench/common.py `job_names`),
each in its shard's database (SCHEDULER_SHARD_DATABASES, when set).
"""

from __future__ import annotations

import argparse

import django


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs-per-shard", type=int, default=0)
    args = parser.parse_args()
    django.setup()
    from apps.jobs.models import JobDefinition
    from apps.jobs.schedule import shard_for
    from apps.runs import shards
    from apps.teams.models import Team
    from bench import common

    names = common.job_names(args.jobs_per_shard)
    # The bench computes shards without Django: it must agree with the product.
    assert all(shard_for(name) == common.shard_for(name) for name in names), (
        "bench/common.py shard_for no longer matches apps/jobs/schedule.py"
    )
    team = Team.objects.get(slug="bench")
    for name in [common.JOB, *names]:
        # A query that names no database reads the first shard database only.
        with shards.using(shards.alias_of_shard(shard_for(name))):
            JobDefinition.objects.update_or_create(
                name=name,
                defaults={
                    "team": team,
                    "schedule": {},
                    "queue": common.QUEUE,
                    "timeout_seconds": 3600,
                    "shard": shard_for(name),
                },
            )


if __name__ == "__main__":
    main()
