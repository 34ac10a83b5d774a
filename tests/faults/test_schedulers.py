"""Scheduler faults with real `manage.py scheduler` processes (tick 0.2 s, shard leases of 2 s):
two nodes that both believe they own a shard, and a scheduler that was down for 150 ticks. Both
layouts: the shard leases are in the control database, each job and its runs in its shard's.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from apps.scheduler import leases
from apps.scheduler.daemon import Scheduler
from tests.conftest import db_now
from tests.faults.helpers import (
    definition_url,
    every_fire_time_once,
    frozen,
    snapshot,
    wait_for,
)
from tests.scheduler.helpers import leases_by_owner, names_in_shard

pytestmark = [
    pytest.mark.slow,
    pytest.mark.shards,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]

ALL = list(range(16))
TTL = 2


def minutely(policy: str = "run_all") -> dict:
    return {"cron": "* * * * *", "jitterSeconds": 0, "missedRunPolicy": policy}


def floor_minute(moment):
    return moment.replace(second=0, microsecond=0)


def epochs() -> dict[int, int]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT shard, epoch FROM scheduler_shardlease")
        return dict(cursor.fetchall())


def test_a_scheduler_that_slept_past_its_shard_leases_is_refused_by_the_epoch_check(harness):
    h = harness
    db = h.db
    first_due = floor_minute(db_now()) - timedelta(minutes=3)
    initial = {
        h.definition(name, "sched", schedule=minutely(), next_due_at=first_due): first_due
        for shard in (0, 5, 10, 15)
        for name in names_in_shard(shard, 1, prefix="fleet")
    }

    # 1. An in-process node takes every shard (and materialises the fleet), then sleeps: it is
    #    simply not stepped, exactly like a process stopped between two statements.
    stale = Scheduler(node_id="stale", tick_seconds=0.2, lease_seconds=TTL)
    stale.tick()
    assert sorted(stale.held) == ALL
    stale_epochs = dict(stale.held)

    # 2. Two scheduler processes start after its leases have run out and split the shards.
    a, b = h.scheduler("node-a"), h.scheduler("node-b")
    owners = wait_for(
        lambda: (o := leases_by_owner()) and sorted(map(len, o.values())) == [8, 8] and o,
        40,
        "node-a and node-b to split the shards",
    )
    assert set(owners) == {"node-a", "node-b"}

    # 3. node-b is frozen too; the stale node still believes it owns node-b's shards. A job
    #    falls due in one of them: the stale node's write is refused (owner and epoch checked
    #    inside its transaction), it writes nothing and forgets the shard; renewing is refused.
    shard = owners["node-b"][0]
    (name,) = names_in_shard(shard, 1, prefix="due-while-frozen")
    due_now = floor_minute(db_now())
    with frozen(b, db, "faults:sched:node-b"):
        during_b = h.definition(name, "sched", schedule=minutely(), next_due_at=due_now)
        stale.read_clock()
        assert stale.handle_one_materialise(shard) is False
        assert shard not in stale.held
        assert (
            db.scalar("SELECT count(*) FROM runs_run WHERE definition_id = %s", [during_b.pk]) == 0
        )
        assert (
            db.scalar("SELECT next_due_at FROM jobs_jobdefinition WHERE id = %s", [during_b.pk])
            == due_now
        )
        assert leases.renew("stale", stale.held, TTL) == {}
    initial[during_b] = due_now
    wait_for(
        lambda: db.scalar("SELECT count(*) FROM runs_run WHERE definition_id = %s", [during_b.pk]),
        10,
        "node-b to materialise the job once thawed",
    )

    # 4. node-a is frozen (SIGSTOP) past its lease TTL: node-b takes every shard over, with new
    #    epochs, and materialises a job that falls due in one of node-a's shards meanwhile.
    a_epochs = {s: e for s, e in epochs().items() if s in owners["node-a"]}
    with frozen(a, db, "faults:sched:node-a"):
        wait_for(lambda: leases_by_owner() == {"node-b": ALL}, TTL + 15, "node-b to take over")
        (name,) = names_in_shard(owners["node-a"][0], 1, prefix="due-while-a-sleeps")
        during_a = h.definition(name, "sched", schedule=minutely(), next_due_at=due_now)
        wait_for(
            lambda: db.scalar(
                "SELECT count(*) FROM runs_run WHERE definition_id = %s", [during_a.pk]
            ),
            10,
            "node-b to materialise in node-a's former shard",
        )
        initial[during_a] = due_now
    # SIGCONT: node-a wakes up believing it holds its 8 shards; its renewal (or its next
    # materialisation) is refused, it drops them, and the two nodes share the shards again.
    wait_for(
        lambda: "lost shards" in a.output() or "no longer holds shard" in a.output(),
        15,
        "node-a to find its leases gone",
    )
    wait_for(lambda: sorted(map(len, leases_by_owner().values())) == [8, 8], 20, "a new split")
    now_epochs = epochs()
    for shard, epoch in a_epochs.items():
        assert now_epochs[shard] > epoch
    for shard, epoch in stale_epochs.items():
        assert now_epochs[shard] > epoch
    assert a.alive() and b.alive()

    # No duplicate and no missing run, whoever wrote them.
    time.sleep(0.5)
    for definition, first in initial.items():
        every_fire_time_once(db, definition.pk, first, definition.schedule)
    h.check()


def test_a_scheduler_down_for_150_ticks_applies_the_missed_run_policy_with_its_cap(harness):
    h = harness
    db = h.db
    cap = 100
    started = db_now()
    first_due = floor_minute(started) - timedelta(minutes=150)
    definitions = {
        policy: h.definition(
            f"missed.{policy}", "missed", schedule=minutely(policy), next_due_at=first_due
        )
        for policy in ("run_all", "run_once", "skip")
    }
    node = h.scheduler("node-late", SCHEDULER_MISSED_RUNS_CAP=str(cap))

    def caught_up() -> bool:
        return all(
            db.scalar(
                "SELECT next_due_at > %s FROM jobs_jobdefinition WHERE id = %s", [started, d.pk]
            )
            for d in definitions.values()
        )

    wait_for(caught_up, 40, "the scheduler to catch up")

    def state(definition) -> tuple[list, list, object, str]:
        """Catch-up due times, cron due times, next_due_at and the note, in one snapshot."""
        with snapshot(db, definition_url(definition.pk)) as conn:
            due = conn.execute(
                "SELECT due_at, trigger FROM runs_run WHERE definition_id = %s ORDER BY due_at",
                [definition.pk],
            ).fetchall()
            next_due, note = conn.execute(
                "SELECT next_due_at, missed_runs_note FROM jobs_jobdefinition WHERE id = %s",
                [definition.pk],
            ).fetchone()
        catch_up = [at for at, trigger in due if trigger == "catch_up"]
        cron = [at for at, trigger in due if trigger == "cron"]
        assert len(catch_up) + len(cron) == len(due)
        return catch_up, cron, next_due, note

    def consecutive(times: list) -> bool:
        return all(b - a == timedelta(minutes=1) for a, b in zip(times, times[1:], strict=False))

    seen = {}
    for policy, definition in definitions.items():
        catch_up, cron, next_due, note = state(definition)
        # The schedule goes on: upcoming minutes are cron runs, up to the next due time.
        assert cron and consecutive(cron) and cron[-1] + timedelta(minutes=1) == next_due
        assert cron[-1] >= floor_minute(started)
        expected = {"run_all": cap, "run_once": 1, "skip": 0}[policy]
        assert len(catch_up) == expected, (policy, len(catch_up))
        # The catch-up runs are the latest missed times, right before the first cron run.
        assert consecutive(catch_up + cron), policy
        if catch_up:
            assert catch_up[0] > first_due  # 150 were missed; the cap kept the latest 100
        assert (f"cap of {cap}" in note) == (policy == "run_all"), note
        seen[policy] = (catch_up, cron)

    # Later ticks insert no catch-up run again; cron runs only go on (a minute may pass).
    time.sleep(1)
    for policy, definition in definitions.items():
        catch_up, cron, _, _ = state(definition)
        assert catch_up == seen[policy][0]
        assert cron[: len(seen[policy][1])] == seen[policy][1]
    assert node.alive()
    h.check()
