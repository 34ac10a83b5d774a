"""The demo team, its sign-in and the handful of jobs a new user sees running."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from apps.audit.record import Actor
from apps.jobs import services
from apps.jobs.models import JobDefinition
from apps.notify import channels
from apps.notify.models import Channel
from apps.runs.models import PRIORITIES
from apps.teams.models import ApiToken, Membership, Role, Team

TEAM_SLUG = "demo"
USERNAME = "demo"
PASSWORD = "demo-password"
QUEUE = "demo"
# A partner's API allows one call every 150 s: the queue's rate limit holds its runs, the job's
# lateness SLO of 20 s makes them late, and the queues page shows the window in use.
THROTTLED_QUEUE = "demo-throttled"
THROTTLE = (1, 150)
WORKER_TOKEN_NAME = "demo worker"


def _spec(name: str, schedule: dict, **fields) -> services.DefinitionSpec:
    return services.DefinitionSpec(
        name=name,
        schedule=schedule,
        queue=QUEUE,
        priority=PRIORITIES[fields.pop("priority", "default")],
        timeout_seconds=fields.pop("timeout_seconds", 300),
        retry_max_attempts=fields.pop("retry_max_attempts", 3),
        retry_base_seconds=fields.pop("retry_base_seconds", 5),
        retry_max_seconds=fields.pop("retry_max_seconds", 60),
        concurrency=fields.pop("concurrency", None),
        payload=fields.pop("payload", {}),
        paused=False,
        dry_run=False,
    )


DEMO_JOBS = [
    _spec(
        "demo.nightly-report",
        {"cron": "0 2 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0},
        priority="critical",
        concurrency=1,
        payload={"format": "csv"},
    ),
    _spec(
        "demo.every-minute",
        {"cron": "* * * * *", "jitterSeconds": 0},
        payload={"greeting": "hello"},
    ),
    _spec(
        "demo.flaky",
        {"cron": "* * * * *", "jitterSeconds": 0},
        priority="bulk",
        retry_max_attempts=2,
        retry_base_seconds=1,
        retry_max_seconds=2,
        payload={"failureRate": 0.5},
    ),
    _spec("demo.delayed-email", {"delaySeconds": 20}, payload={"to": "ops@example.com"}),
    replace(
        _spec("demo.partner-sync", {"cron": "* * * * *", "jitterSeconds": 0}),
        queue=THROTTLED_QUEUE,
        lateness_slo_seconds=20,
        owner="partners-oncall@example.com",
    ),
]


def seed_runs(team: Team) -> None:
    """Runs to watch at once, rather than at the next minute: one that succeeds, one for the DLQ."""
    from apps.jobs.enqueue import create_run

    actor = Actor.cli("demo")
    create_run(
        JobDefinition.objects.named("demo.every-minute").get(),
        actor,
        idempotency_key=None,
        trigger="manual",
    )
    create_run(
        JobDefinition.objects.named("demo.flaky").get(),
        actor,
        idempotency_key=None,
        trigger="manual",
        payload={"alwaysFail": True},
    )
    # A run of the throttled job that was due five minutes ago: late as soon as it starts.
    create_run(
        JobDefinition.objects.named("demo.partner-sync").get(),
        actor,
        idempotency_key=None,
        run_at=timezone.now() - timedelta(minutes=5),
    )


# Pages the demo team: `make run` prints its emails in the scheduler's output (the console
# email backend); the flaky job's dead runs page it, and it hears when the job recovers.
DEMO_CHANNEL = "demo on-call"


def ensure_channel(team: Team, actor: Actor) -> None:
    """Give the demo team its email channel, once."""
    if Channel.objects.filter(team=team, name=DEMO_CHANNEL).exists():
        return
    spec = channels.ChannelSpec(
        name=DEMO_CHANNEL,
        kind="email",
        target="oncall@example.com",
        events=["run.dead", "job.recovered"],
    )
    channels.create(team, spec, actor)


@dataclass(frozen=True)
class Demo:
    team: Team
    token: str


@transaction.atomic
def load_demo() -> Demo:
    """Create or refresh the demo team, user, jobs and a new worker token (the old one is revoked)."""
    actor = Actor.cli("demo")
    team, _ = Team.objects.get_or_create(slug=TEAM_SLUG, defaults={"name": "Demo team"})
    user_model = get_user_model()
    user = user_model.objects.filter(username=USERNAME).first()
    if user is None:
        user = user_model.objects.create_user(USERNAME, password=PASSWORD)
    Membership.objects.update_or_create(user=user, team=team, defaults={"role": Role.ADMIN})
    for spec in DEMO_JOBS:
        existing = JobDefinition.objects.named(spec.name).first()
        if existing is None:
            services.create_definition(team, spec, actor)
        elif existing.schedule.get("delaySeconds") is not None:
            # A delayed job runs once after creation: recreate it so every start shows one.
            services.delete_definition(existing, actor)
            services.create_definition(team, spec, actor)
        else:
            services.update_definition(existing, spec, actor)
    ApiToken.objects.filter(team=team, name=WORKER_TOKEN_NAME, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    _, raw = ApiToken.issue(team, ["worker", "manage"], name=WORKER_TOKEN_NAME)
    services.set_queue_settings(team, THROTTLED_QUEUE, actor, rate_limit=THROTTLE, paused=None)
    ensure_channel(team, actor)
    seed_runs(team)
    return Demo(team, raw)
