"""`manage.py scheduler` as real processes: sharing shards, failover, graceful shutdown."""

from __future__ import annotations

import signal
import time
from datetime import timedelta

import psycopg
import pytest
from django.db import connection

from apps.jobs import firetimes
from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition
from apps.runs.models import Run
from apps.scheduler.models import SchedulerNode
from tests.scheduler.helpers import (
    SchedulerProcess,
    a_definition,
    db_now,
    floor_minute,
    leases_by_owner,
    names_in_shard,
    wait_for,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ALL = list(range(16))
TTL = 2
TICK = 0.2
FAST = {"SCHEDULER_SHARD_LEASE_SECONDS": str(TTL), "SCHEDULER_TICK_SECONDS": str(TICK)}
MINUTELY = {"cron": "* * * * *", "jitterSeconds": 0, "missedRunPolicy": "run_all"}


@pytest.fixture
def processes(tmp_path):
    """Start scheduler processes; stop every one of them after the test, and show their logs."""
    started: list[SchedulerProcess] = []

    def start(node_id: str, *args: str, **env: str) -> SchedulerProcess:
        process = SchedulerProcess(node_id, tmp_path, *args, **{**FAST, **env})
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()
        print(f"--- {process.node_id} ---\n{process.output()}")


def all_materialised() -> bool:
    return not JobDefinition.objects.filter(next_due_at__lte=db_now()).exists()


def assert_every_fire_time_has_exactly_one_run(initial: dict[int, object]) -> None:
    """Each definition has one run per fire time from its first due time up to its next_due_at."""
    for definition in JobDefinition.objects.filter(pk__in=initial):
        parsed = sched.parse_schedule(definition.schedule)
        expected = [
            f.utc
            for f in firetimes.fire_times_between(
                parsed,
                initial[definition.pk] - timedelta(seconds=1),
                definition.next_due_at - timedelta(seconds=1),
                10_000,
            )
        ]
        due = sorted(Run.objects.filter(definition=definition).values_list("due_at", flat=True))
        assert due == expected, definition.name


def test_two_processes_split_the_shards_and_the_survivor_takes_over_after_a_kill(processes):
    now = db_now()
    first_due = floor_minute(now) - timedelta(minutes=3)
    for shard in ALL:
        for name in names_in_shard(shard, 3, prefix="fleet"):
            a_definition(name, MINUTELY, first_due)
    a, b = processes("node-a"), processes("node-b")

    # Disjoint halves covering all 16 shards, and every definition materialised.
    owners = wait_for(
        lambda: (o := leases_by_owner()) and sorted(map(len, o.values())) == [8, 8] and o, 30
    )
    assert set(owners) == {"node-a", "node-b"}
    assert sorted(owners["node-a"] + owners["node-b"]) == ALL
    wait_for(all_materialised, 10)

    a.proc.kill()
    killed_at = time.monotonic()
    a.wait(5)
    # New work in a's shards while nobody owns them: due at the current minute.
    due_now = floor_minute(db_now())
    for shard in owners["node-a"]:
        for name in names_in_shard(shard, 2, prefix="after-kill"):
            a_definition(name, MINUTELY, due_now)

    wait_for(lambda: leases_by_owner() == {"node-b": ALL}, TTL + 10)
    took = time.monotonic() - killed_at
    # Within one TTL and one tick, plus room for a loaded machine.
    assert took <= TTL + TICK + 1.5, took
    wait_for(all_materialised, 10)

    initial = {
        d.pk: first_due if d.name.startswith("fleet") else due_now
        for d in JobDefinition.objects.all()
    }
    assert len(initial) == 16 * 3 + 8 * 2
    assert_every_fire_time_has_exactly_one_run(initial)
    assert b.proc.poll() is None


def test_sigterm_releases_the_shards_to_the_other_node_within_two_seconds(processes):
    first = processes("node-first")
    wait_for(lambda: leases_by_owner() == {"node-first": ALL}, 30)
    second = processes("node-second")
    wait_for(lambda: len(leases_by_owner().get("node-second", [])) == 8, 30)

    first.signal(signal.SIGTERM)
    sent_at = time.monotonic()
    wait_for(lambda: leases_by_owner() == {"node-second": ALL}, 5, interval=0.02)

    assert time.monotonic() - sent_at < 2
    assert first.wait(10) == 0
    assert not SchedulerNode.objects.filter(node_id="node-first").exists()
    second.signal(signal.SIGTERM)
    assert second.wait(10) == 0
    assert leases_by_owner() == {}


def test_once_materialises_one_tick_then_exits_and_releases(processes):
    due = floor_minute(db_now()) + timedelta(minutes=1)
    definition = a_definition("ops.once", {"cron": "* * * * *"}, due)

    process = processes("node-once", "--once")

    assert process.wait(30) == 0
    assert Run.objects.filter(definition=definition, due_at=due, trigger="cron").count() == 1
    assert leases_by_owner() == {}


def test_a_session_holding_a_table_the_tick_writes_does_not_cost_the_node_its_shards(processes):
    """The retention round (the owner of shard 0's) deletes from the audit trail: behind a
    session holding that table for three leases, its tick waited, and its leases lapsed. Its
    statements give up after a third of a lease; the next tick renews."""
    node = processes("node-held", SCHEDULER_RETENTION_INTERVAL_SECONDS="1")
    wait_for(lambda: leases_by_owner() == {"node-held": ALL}, 30)
    with psycopg.connect(**connection.get_connection_params()) as holder:
        holder.execute("LOCK TABLE audit_auditevent IN ACCESS EXCLUSIVE MODE")
        held_until = time.monotonic() + 3 * TTL + 1
        lapsed = []
        while time.monotonic() < held_until:
            if (owners := leases_by_owner()) != {"node-held": ALL}:
                lapsed.append(owners)
            time.sleep(0.1)
        holder.rollback()
    assert lapsed == []
    # Not by chance: its retention did try the table while it was held, and gave up.
    assert "canceling statement due to lock timeout" in node.output()
    assert node.proc.poll() is None
