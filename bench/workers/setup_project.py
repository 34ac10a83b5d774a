"""Create the benchmark's job definition (`bench.noop`, queue `bench`, no schedule) with the ORM.

    DATABASE_URL=… python -m bench.workers.setup_project
"""

from __future__ import annotations

import django


def main() -> None:
    django.setup()
    from apps.jobs.models import JobDefinition
    from apps.jobs.schedule import shard_for
    from apps.teams.models import Team
    from bench.common import JOB, QUEUE

    team = Team.objects.get(slug="bench")
    JobDefinition.objects.update_or_create(
        name=JOB,
        defaults={
            "team": team,
            "schedule": {},
            "queue": QUEUE,
            "timeout_seconds": 3600,
            "shard": shard_for(JOB),
        },
    )


if __name__ == "__main__":
    main()
