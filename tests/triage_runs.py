"""Many failed runs at once, for the triage tests: one INSERT … SELECT, as the fail statement
would have left them (state, last error, its fingerprint, the failure time), never one by one."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import connections

from apps.jobs.models import JobDefinition, database_of
from apps.runs import fingerprints
from apps.teams.models import Membership, Team

INSERT_FAILED = """
INSERT INTO runs_run (
    id, definition_id, team_id, queue, priority, shard, state, trigger, due_at, available_at,
    attempt, max_attempts, idempotency_key, lease_seconds, worker_id, dry_run, payload_key,
    created_at, last_error, error_fingerprint, failed_at, finished_at
)
SELECT nextval('runs_run_id_seq') * 1024 + d.shard, d.id, d.team_id, d.queue, d.priority,
       d.shard, %(state)s, 'api', now() - make_interval(secs => g), now() + interval '1 hour',
       d.retry_max_attempts, d.retry_max_attempts, %(prefix)s || g, 60, 'worker-1/1', false, '',
       now() - make_interval(secs => g),
       jsonb_build_object('type', %(type)s::text, 'message', format(%(message)s, g)),
       %(fingerprint)s, now() - make_interval(secs => g),
       CASE WHEN %(state)s = 'dead' THEN now() - make_interval(secs => g) END
FROM generate_series(1, %(count)s) AS g, jobs_jobdefinition d
WHERE d.id = %(definition)s
"""


def insert_failed(
    definition: JobDefinition,
    count: int,
    *,
    state: str = "dead",
    error_type: str = "KeyError",
    message: str = "'user %s'",
    prefix: str | None = None,
) -> int:
    """Insert `count` failed runs of the definition whose messages differ by a number (`%s` in
    `message` is the run's ordinal): one group. Return the group's fingerprint. Their
    idempotency keys are `prefix` and the ordinal (by default the state and the group)."""
    fingerprint = fingerprints.of(error_type, message.replace("%s", "1"))
    if prefix is None:
        prefix = f"{state}-{fingerprints.to_hex(fingerprint)}-"
    with connections[database_of(definition.name)].cursor() as cursor:
        cursor.execute(
            INSERT_FAILED,
            {
                "state": state,
                "prefix": prefix,
                "type": error_type,
                "message": message,
                "fingerprint": fingerprint,
                "count": count,
                "definition": definition.pk,
            },
        )
    return fingerprint


def person(username: str, team: Team, role: str):
    """A member of `team` who signs in by session only (tests force the login): no password,
    so no 0.5 s of password hashing per test."""
    user = get_user_model().objects.create(username=username)
    user.set_unusable_password()
    user.save(update_fields=["password"])
    Membership.objects.create(user=user, team=team, role=role)
    return user
