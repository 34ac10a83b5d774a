"""Rate limits and per-key concurrency on the claim, under eight concurrent claimers each on its
own database connection, in both layouts."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter

import pytest
from django.db import connections

from apps.jobs.models import JobDefinition, Queue, QueueStart
from apps.jobs.schedule import shard_for
from apps.runs import leasing, shards, store
from apps.runs.models import Attempt, Run
from tests.conftest import (
    add_ready_runs,
    claim,
    db_now,
    expire_lease,
    make_definition,
    stored,
    stored_one,
)
from tests.runs.test_claim_concurrency import run_in_threads

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]


def keyed_runs(definition, keys: list[str], prefix: str) -> list[int]:
    """One claimable run per entry of `keys`, in this order, each with that concurrency key."""
    ids = add_ready_runs(definition, len(keys), prefix=prefix)
    assert len(ids) == len(keys)
    alias = shards.alias_of_shard(definition.shard)
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run r SET concurrency_key = k.key"
            " FROM unnest(%s::bigint[], %s::text[]) AS k(id, key) WHERE r.id = k.id",
            [ids, keys],
        )
    return ids


def claim_all(
    team, queue: str | list[str], claimers: int = 8, max_runs: int = 5
) -> list[store.Lease]:
    """Eight claimers claim until none gets anything; every lease they took."""

    def worker(index: int) -> list[store.Lease]:
        taken: list[store.Lease] = []
        while batch := claim(
            queues=[queue] if isinstance(queue, str) else queue,
            max_runs=max_runs,
            worker_id=f"w{index}",
            lease_seconds=60,
            team_ids=[team.pk],
        ):
            taken += batch
        return taken

    return [lease for taken in run_in_threads(claimers, worker) for lease in taken]


def test_a_rate_limit_holds_under_eight_claimers_and_frees_as_the_window_slides(team_a):
    limited = make_definition(
        team_a, "mail.send", queue="mail", rate_limit_count=7, rate_limit_period_seconds=2
    )
    free = make_definition(team_a, "mail.log", queue="mail")
    add_ready_runs(limited, 40)
    free_ids = add_ready_runs(free, 30, prefix="f")

    first = claim_all(team_a, "mail")
    by_job = Counter(lease.job for lease in first)
    # At most 7 starts in the window, whatever the claimers did at once; the limited job is
    # skipped, not waited on: every run of the other job was leased beside it.
    assert by_job == {"mail.send": 7, "mail.log": 30}
    assert {lease.id for lease in first if lease.job == "mail.log"} == set(free_ids)
    # Completing frees no slot: the rate counts starts, not leases held.
    store.complete([(lease.id, lease.fencing_token, None) for lease in first], team_ids=[team_a.pk])
    assert claim_all(team_a, "mail") == []
    # The claim that found the window full keeps later claims off the definition until then.
    assert stored_one(type(limited), pk=limited.pk).rate_blocked_until is not None

    time.sleep(2.1)  # the window slides past the first starts
    second = claim_all(team_a, "mail")
    assert len(second) == 7
    assert len(stored(Run, definition_id=limited.pk, state="leased")) == 7


def test_a_keys_slot_frees_exactly_once_and_a_hot_key_never_blocks_the_others(team_a):
    definition = make_definition(team_a, "export.customer", queue="exports", concurrency_per_key=2)
    # A hot key's backlog at the head of the queue, then one run each of five other keys.
    hot = keyed_runs(definition, ["hot"] * 50, "hot")
    cold = keyed_runs(definition, [f"c{n}" for n in range(5)], "cold")

    leases = claim_all(team_a, "exports")
    keys = Counter(stored_one(Run, pk=lease.id).concurrency_key for lease in leases)
    assert keys == {"hot": 2, **{f"c{n}": 1 for n in range(5)}}
    assert {lease.id for lease in leases} >= set(cold)

    # The hot key's slots free once each: on complete, fail, expiry and cancel alike.
    held = [lease for lease in leases if lease.id in hot]
    done, failed = held
    store.complete([(done.id, done.fencing_token, None)], team_ids=[team_a.pk])
    store.fail([(failed.id, failed.fencing_token, {"message": "x"}, False)], team_ids=[team_a.pk])
    again = claim_all(team_a, "exports")
    assert len(again) == 2 and {lease.id for lease in again} <= set(hot)
    expire_lease(again[0].id)
    assert [item.id for item in store.reap()] == [again[0].id]
    assert len(claim_all(team_a, "exports")) == 1  # the expired lease's slot, once
    assert claim_all(team_a, "exports") == []


def test_runs_without_a_key_are_held_only_by_the_jobs_own_limit(team_a):
    definition = make_definition(
        team_a, "export.any", queue="anykey", concurrency=4, concurrency_per_key=1
    )
    keyed_runs(definition, ["a", "a", "a"], "a")
    add_ready_runs(definition, 6, prefix="nokey")
    leases = claim_all(team_a, "anykey")
    assert len(leases) == 4  # the definition's concurrency
    keys = Counter(stored_one(Run, pk=lease.id).concurrency_key for lease in leases)
    assert keys["a"] <= 1


def test_a_cron_run_takes_its_key_from_the_named_payload_field(team_a):
    definition = make_definition(
        team_a,
        "export.nightly",
        queue="nightly",
        concurrency_per_key=1,
        concurrency_key_field="customer",
        payload={"customer": "acme"},
    )
    (pk,) = add_ready_runs(definition, 1)
    assert stored_one(Run, pk=pk).concurrency_key == "acme"


def test_a_payload_fields_key_stays_distinct_past_200_characters_and_empty_is_no_key(team_a):
    definition = make_definition(
        team_a, "export.long", queue="longkey", concurrency_per_key=1, concurrency_key_field="c"
    )
    # Two customers whose names share their first 200 characters, and one with an empty name.
    shared = "x" * 200
    now = db_now()
    values = [shared + "-one", shared + "-two", shared + "-one", "", ""]
    with shards.using(shards.alias_of_shard(definition.shard)):
        ids = store.insert_runs(
            [
                store.NewRun(definition.pk, "api", now, now, f"k{i}", payload={"c": value})
                for i, value in enumerate(values)
            ]
        )
    keys = [stored_one(Run, pk=pk).concurrency_key for pk in ids]
    assert all(key is None or len(key) <= 200 for key in keys)
    assert keys[0] != keys[1] and keys[0] == keys[2]  # distinct names, distinct keys
    assert keys[3] is None and keys[4] is None  # an empty name is no key, as a missing one
    leases = claim_all(team_a, "longkey")
    # One of each long name (their slot of one), and both runs without a key.
    assert sorted(ids.index(lease.id) for lease in leases) in ([0, 1, 3, 4], [1, 2, 3, 4])


def test_why_names_a_spent_rate_limit_and_a_held_key(team_a):
    from apps.jobs import diagnosis
    from apps.runs.clock import database_now

    rated = make_definition(
        team_a, "mail.digest", queue="digest", rate_limit_count=2, rate_limit_period_seconds=60
    )
    add_ready_runs(rated, 3)
    assert len(claim_all(team_a, "digest")) == 2
    with shards.using(shards.alias_of_shard(rated.shard)):
        reasons = diagnosis.why_definition(rated, database_now())
    (limit,) = [reason for reason in reasons if reason.code == "rate_limit"]
    assert limit.detail["count"] == 2 and 55 < limit.detail["nextSlotInSeconds"] <= 60
    assert "Rate limit: 2/60 s" in limit.message

    keyed = make_definition(team_a, "export.one", queue="keyed", concurrency_per_key=1)
    pair = keyed_runs(keyed, ["acme", "acme"], "k")
    # One of the two (the older one unless two claimers raced for them).
    (lease,) = claim_all(team_a, "keyed")
    (other,) = set(pair) - {lease.id}
    reasons = diagnosis.why_run(stored_one(Run, pk=other), database_now())
    (held,) = [reason for reason in reasons if reason.code == "key_concurrency_limit"]
    assert held.detail == {
        "limit": 1,
        "key": "acme",
        "heldBy": [stored_one(Run, pk=lease.id).run_id],
    }
    # The job's own why names the held key (a key with nothing ready is not named).
    keyed_runs(keyed, ["globex"], "g")
    assert len(claim_all(team_a, "keyed")) == 1  # globex's: its key is free
    reasons = diagnosis.why_definition(keyed, database_now())
    (held,) = [reason for reason in reasons if reason.code == "key_concurrency_limit"]
    holder = stored_one(Run, pk=lease.id).run_id
    assert held.detail == {"limit": 1, "keys": [{"key": "acme", "heldBy": [holder]}]}
    assert (
        held.message
        == f"The limit of 1 per key is held, with runs ready behind it, for 'acme' (by {holder})."
    )


def names_on_every_database(prefix: str, per_database: int) -> list[str]:
    """Job names whose shards cover every database, `per_database` on each."""
    found: dict[str, list[str]] = {alias: [] for alias in shards.databases()}
    for n in range(10_000):
        name = f"{prefix}.{n}"
        group = found[shards.alias_of_shard(shard_for(name))]
        if len(group) < per_database:
            group.append(name)
        if all(len(group) == per_database for group in found.values()):
            return [name for group in found.values() for name in group]
    raise AssertionError("no such names")


def test_a_queue_rate_limit_holds_for_its_jobs_together_across_databases(team_a, team_b):
    """Eight claimers asking a rate-limited queue and a free one: the queue's window holds for
    all of its jobs at once, whichever shard database holds them (with shards on servers of
    their own, the window lives in the control database), and the free queue is drained."""
    Queue.objects.create(team=team_a, name="bulk", rate_limit_count=9, rate_limit_period_seconds=2)
    leasing.control_state.forget()
    limited = [
        make_definition(team_a, name, queue="bulk") for name in names_on_every_database("bulk", 2)
    ]
    for definition in limited:
        add_ready_runs(definition, 10)
    free_ids = add_ready_runs(make_definition(team_a, "free.one", queue="free"), 30, prefix="f")
    # Another team's queue of the same name is not limited by this one's.
    theirs = add_ready_runs(make_definition(team_b, "their.bulk", queue="bulk"), 12, prefix="b")

    first = claim_all(team_a, ["bulk", "free"])
    by_queue = Counter(lease.queue for lease in first)
    assert by_queue == {"bulk": 9, "free": 30}
    assert {lease.id for lease in first if lease.queue == "free"} == set(free_ids)
    assert len(claim_all(team_b, ["bulk"])) == len(theirs)
    assert QueueStart.objects.filter(queue__team=team_a).count() == 9
    assert claim_all(team_a, ["bulk", "free"]) == []

    time.sleep(2.1)  # the window slides past the first starts
    assert len(claim_all(team_a, ["bulk"])) == 9


def test_a_queue_windows_starts_are_stamped_no_earlier_than_its_runs_started(team_a):
    """With shard databases of their own, a queue's starts were stamped with the control
    transaction's start, before its wait for the queue's lock and before the runs' own starts
    (their shard transactions begin after it): back-dated, they left the window early, and a
    window of the runs' start times let more through than the limit."""
    Queue.objects.create(team=team_a, name="bulk", rate_limit_count=9, rate_limit_period_seconds=60)
    leasing.control_state.forget()
    for name in names_on_every_database("bulk", 2):
        add_ready_runs(make_definition(team_a, name, queue="bulk"), 2)
    leased = claim(queues=["bulk"], max_runs=9, worker_id="w", team_ids=[team_a.pk])
    started = [attempt.leased_at for attempt in stored(Attempt)]
    stamps = list(
        QueueStart.objects.filter(queue__team=team_a).values_list("started_at", flat=True)
    )
    assert len(leased) == len(started) == len(stamps) >= 4
    assert min(stamps) >= max(started), (stamps, started)


def test_every_key_of_many_is_reached_in_turn_past_a_hot_one(team_a):
    """300 keys at one lease each, a hot key's backlog ahead of them all: claims of five visit
    the keys from where the last one stopped, wrapping round, so each key is leased once and
    the hot key once, without any run being completed."""
    definition = make_definition(team_a, "export.many", queue="many", concurrency_per_key=1)
    keyed_runs(definition, ["0-hot"] * 400, "hot")
    keyed_runs(definition, [f"k{n:03d}" for n in range(300)], "cold")
    leased: list[store.Lease] = []
    while batch := claim(queues=["many"], max_runs=5, worker_id="w", team_ids=[team_a.pk]):
        leased += batch
    keys = Counter(stored_one(Run, pk=lease.id).concurrency_key for lease in leased)
    assert keys == {"0-hot": 1, **{f"k{n:03d}": 1 for n in range(300)}}


def test_a_limit_given_or_lifted_after_runs_exist_holds_their_runs_or_frees_them(team_a):
    from apps.audit.record import Actor
    from apps.jobs import services

    definition = make_definition(team_a, "late.limit", queue="late")
    add_ready_runs(definition, 6)
    spec = services.spec_of(definition)
    limited = services.update_definition(
        definition, dataclasses.replace(spec, concurrency=2), Actor.system()
    )
    assert {run.limited for run in stored(Run, definition_id=definition.pk)} == {True}
    assert len(claim_all(team_a, "late")) == 2
    services.update_definition(limited, dataclasses.replace(spec, concurrency=None), Actor.system())
    assert {run.limited for run in stored(Run, definition_id=definition.pk)} == {False}
    assert len(claim_all(team_a, "late")) == 4  # the rest, now taken as anyone's runs


def test_a_limit_lifted_and_given_again_while_claimers_lease_deadlocks_no_one(team_a):
    """An edit locks the definition, then rewrites its runs' `limited`; a claim has locked
    some of those runs and then counts the definition's leases under its own lock. When that
    lock was the definition's row, each waited for the other until PostgreSQL's deadlock
    detector failed one of them (503s to the edit and to workers)."""
    from apps.audit.record import Actor
    from apps.jobs import services

    definition = make_definition(team_a, "busy.limit", queue="busy", concurrency=3)
    add_ready_runs(definition, 2000)
    lifted = threading.Event()

    def work(index: int) -> int:
        if index == 0:
            current = definition
            try:
                for turn in range(8):
                    spec = dataclasses.replace(
                        services.spec_of(current), concurrency=None if turn % 2 == 0 else 3
                    )
                    current = services.update_definition(current, spec, Actor.system())
                    time.sleep(0.05)
            finally:
                lifted.set()
            return 0
        done = 0
        while not lifted.is_set():
            batch = claim(queues=["busy"], max_runs=2, worker_id=f"w{index}", team_ids=[team_a.pk])
            items = [(lease.id, lease.fencing_token, None) for lease in batch]
            time.sleep(0.01)  # the work
            store.complete(items, team_ids=[team_a.pk])
            done += len(batch)
        return done

    assert sum(run_in_threads(5, work)) > 0  # a deadlock is raised in its thread, and re-raised
    # The last edit gave the limit back: every unfinished run is marked so.
    waiting = stored(Run, definition_id=definition.pk, state="scheduled")
    assert waiting and {run.limited for run in waiting} == {True}


def test_a_free_key_past_a_long_stretch_of_full_ones_is_reached(team_a):
    """150 keys whose one slot is held, then one free key: each claim visits at most the batch
    plus 16 keys, starting where the last visit ended, so the free key is reached within a few
    claims, not never."""
    definition = make_definition(team_a, "export.stretch", queue="stretch", concurrency_per_key=1)
    full = keyed_runs(definition, [f"a{n:03d}" for n in range(150) for _ in range(2)], "full")
    (free,) = keyed_runs(definition, ["zzz"], "free")
    holders = claim_all(team_a, "stretch")  # one run of every key
    assert len(holders) == 151
    store.complete(
        [(lease.id, lease.fencing_token, None) for lease in holders if lease.id == free],
        team_ids=[team_a.pk],
    )
    (late,) = keyed_runs(definition, ["zzz"], "late")
    got: list[int] = []
    for _ in range(20):
        got += [
            lease.id
            for lease in claim(queues=["stretch"], max_runs=5, worker_id="w", team_ids=[team_a.pk])
        ]
        if got:
            break
    assert got == [late]
    assert set(full) >= {lease.id for lease in holders} - {free}


def test_why_says_when_a_slot_opens_after_a_rate_limit_was_lowered(team_a):
    """The next slot was counted from the oldest start in the window, right only when the
    window holds exactly the limit: lowered from 2 to 1 with starts 20 s apart, it said the
    slot opened 20 s before it did."""
    from apps.jobs import diagnosis
    from apps.runs.clock import database_now

    rated = make_definition(
        team_a, "mail.lowered", queue="lowered", rate_limit_count=2, rate_limit_period_seconds=60
    )
    add_ready_runs(rated, 3)
    assert len(claim_all(team_a, "lowered")) == 2
    alias = shards.alias_of_shard(rated.shard)
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "UPDATE runs_ratestart SET started_at = started_at - interval '20 seconds'"
            " WHERE id = (SELECT min(id) FROM runs_ratestart WHERE definition_id = %s)",
            [rated.pk],
        )
    with shards.using(alias):
        JobDefinition.objects.filter(pk=rated.pk).update(rate_limit_count=1)
        rated.refresh_from_db()
        reasons = diagnosis.why_definition(rated, database_now())
    (limit,) = [reason for reason in reasons if reason.code == "rate_limit"]
    assert 55 < limit.detail["nextSlotInSeconds"] <= 60, limit.detail


def test_why_names_a_concurrency_limit_above_fifty_as_held(team_a):
    """The holders were read 50 at most, then compared with the limit: a limit of 60 held by
    60 runs was never said, and the waiting run's `why` said nothing held it."""
    from apps.jobs import diagnosis
    from apps.runs.clock import database_now
    from apps.runs.models import Run

    wide = make_definition(team_a, "load.wide", queue="wide", concurrency=60)
    ids = add_ready_runs(wide, 62)
    assert len(claim_all(team_a, "wide")) == 60
    alias = shards.alias_of_shard(wide.shard)
    with shards.using(alias):
        waiting = Run.objects.filter(pk__in=ids).exclude(state="leased").first()
        reasons = diagnosis.why_run(waiting, database_now())
    (held,) = [reason for reason in reasons if reason.code == "concurrency_limit"]
    assert len(held.detail["heldBy"]) == 50 and held.message.endswith(" and 10 more.")
