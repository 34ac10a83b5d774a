"""Shard leases between scheduler nodes, driven step by step on real, committed transactions."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection

from apps.jobs.models import JobDefinition
from apps.runs.models import Run
from apps.scheduler import leases
from apps.scheduler.daemon import Scheduler
from apps.scheduler.materialiser import materialise_batch
from apps.scheduler.models import SchedulerNode, ShardLease
from tests.scheduler.helpers import (
    a_definition,
    db_now,
    floor_minute,
    leases_by_owner,
    names_in_shard,
)

pytestmark = pytest.mark.django_db(transaction=True)

ALL = list(range(16))


def node(name: str) -> Scheduler:
    return Scheduler(node_id=name, lease_seconds=10)


def expire_and_silence(name: str) -> None:
    """Make a node look as if it had slept past its TTL: leases expired, no recent announcement."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE scheduler_shardlease SET expires_at = now() - interval '1 second' WHERE owner = %s",
            [name],
        )
        cursor.execute(
            "UPDATE scheduler_schedulernode SET last_seen_at = now() - interval '1 hour'"
            " WHERE node_id = %s",
            [name],
        )


def test_a_lone_node_takes_every_shard():
    a = node("a")

    assert a.handle_one_lease_round() is True

    assert sorted(a.held) == ALL
    assert leases_by_owner() == {"a": ALL}
    assert set(ShardLease.objects.values_list("epoch", flat=True)) == {1}


def test_two_nodes_split_the_shards_and_a_leaving_node_hands_its_share_back():
    a, b = node("a"), node("b")
    a.handle_one_lease_round()

    # b joins: a is over its fair share (8 of 16 for 2 nodes) and gives the extras back; b takes them.
    b.handle_one_lease_round()
    assert b.held == {}
    a.handle_one_lease_round()
    b.handle_one_lease_round()

    assert sorted(a.held) == list(range(8))
    assert sorted(b.held) == list(range(8, 16))
    assert leases_by_owner() == {"a": list(range(8)), "b": list(range(8, 16))}
    # Every change of owner raised the epoch.
    assert {s: e for s, e in b.held.items()} == dict.fromkeys(range(8, 16), 2)

    b.leave()
    assert not SchedulerNode.objects.filter(node_id="b").exists()
    a.handle_one_lease_round()
    assert sorted(a.held) == ALL
    assert a.held[8] == 3


def test_a_node_whose_shards_were_taken_cannot_renew_or_materialise_them():
    a, b = node("a"), node("b")
    a.handle_one_lease_round()
    stale = dict(a.held)
    # a stalls (GC pause, frozen VM) past its TTL; b takes every shard meanwhile.
    expire_and_silence("a")
    b.handle_one_lease_round()
    assert sorted(b.held) == ALL and set(b.held.values()) == {2}
    now = db_now()
    due = floor_minute(now) + timedelta(minutes=1)
    [name] = names_in_shard(7, 1, prefix="stale")
    definition = a_definition(name, {"cron": "* * * * *"}, due)

    # a wakes up mid-tick, still believing it holds shard 7 with epoch 1.
    a.read_clock()
    assert a.handle_one_materialise(7) is False
    assert not Run.objects.filter(definition=definition).exists()
    assert JobDefinition.objects.get(pk=definition.pk).next_due_at == due
    assert 7 not in a.held

    # Nor can it renew what it had: the conditional UPDATE matches no row.
    assert leases.renew("a", stale, 10) == {}
    a._renewed_at = 0
    assert a.handle_one_renewal() is True
    assert a.held == {}
    # The owner name alone is not enough: b with an old epoch is refused too.
    assert leases.renew("b", {7: 1}, 10) == {}
    result = materialise_batch(
        shard=7,
        node="b",
        epoch=1,
        now=now,
        lookahead=timedelta(seconds=60),
        grace=timedelta(seconds=20),
        missed_cap=1000,
        batch=100,
    )
    assert result.lease_held is False
    assert not Run.objects.filter(definition=definition).exists()

    # The current owner materialises it.
    b.read_clock()
    assert b.handle_one_materialise(7) is False
    assert Run.objects.filter(definition=definition, due_at=due).count() == 1
    assert leases_by_owner() == {"b": ALL}


def test_an_expired_lease_is_not_written_under_even_if_nobody_took_it():
    a = node("a")
    a.handle_one_lease_round()
    [name] = names_in_shard(2, 1, prefix="expired")
    due = floor_minute(db_now()) + timedelta(minutes=1)
    definition = a_definition(name, {"cron": "* * * * *"}, due)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE scheduler_shardlease SET expires_at = now() - interval '1 second'")

    a.read_clock()
    assert a.handle_one_materialise(2) is False
    assert not Run.objects.filter(definition=definition).exists()

    # Its next lease round takes the shards again, under a new epoch, and catches up.
    a.tick()
    assert set(a.held.values()) == {2}
    assert Run.objects.filter(definition=definition).count() == 1


def test_leaving_releases_every_shard_at_once():
    a = node("a")
    a.handle_one_lease_round()

    a.leave()

    assert leases_by_owner() == {}
    assert set(ShardLease.objects.values_list("owner", flat=True)) == {""}
    b = node("b")
    b.handle_one_lease_round()
    assert sorted(b.held) == ALL


def test_a_failing_tick_is_logged_and_the_loop_goes_on(monkeypatch, caplog):
    a = Scheduler(node_id="a", lease_seconds=10, tick_seconds=0.01)
    ticks = []
    real_tick = a.tick

    def flaky_tick():
        ticks.append(1)
        if len(ticks) == 1:
            raise RuntimeError("database went away")
        if len(ticks) == 3:
            a.stop()
        return real_tick()

    monkeypatch.setattr(a, "tick", flaky_tick)

    a.run()

    assert len(ticks) == 3
    assert "tick failed" in caplog.text
    # The clean exit still released everything.
    assert leases_by_owner() == {}
    assert not SchedulerNode.objects.filter(node_id="a").exists()
