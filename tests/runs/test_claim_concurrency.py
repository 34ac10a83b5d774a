"""Claims from concurrent workers, each thread on its own database connection."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connections

from apps.runs import store
from apps.runs.models import Attempt, Run
from tests.conftest import add_ready_runs, claim, expire_lease, make_definition, stored

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]


def run_in_threads(count: int, target) -> list:
    """Run `target(index)` in `count` threads at once; return their results; re-raise failures."""
    results: list = [None] * count
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def body(index: int) -> None:
        try:
            barrier.wait(timeout=10)
            results[index] = target(index)
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return results


def test_eight_workers_lease_every_run_exactly_once(team_a):
    definition = make_definition(team_a, "load.noop", queue="load")
    ids = add_ready_runs(definition, 2000)

    def worker(index: int) -> list[store.Lease]:
        taken = []
        while batch := claim(
            queues=["load"],
            max_runs=25,
            worker_id=f"w{index}",
            lease_seconds=60,
            team_ids=[team_a.pk],
        ):
            taken.extend(batch)
        return taken

    leases = [lease for taken in run_in_threads(8, worker) for lease in taken]
    assert sorted(lease.id for lease in leases) == sorted(ids)
    tokens = [lease.fencing_token for lease in leases]
    assert len(set(tokens)) == len(tokens) == 2000
    assert len(stored(Run, state="leased")) == 2000
    assert len(stored(Attempt)) == 2000
    # Each worker got a share: SKIP LOCKED let them work side by side instead of in turn.
    per_worker = Counter(attempt.worker_id for attempt in stored(Attempt))
    assert len(per_worker) >= 2


def test_concurrency_one_holds_under_eight_claimers(team_a):
    definition = make_definition(team_a, "billing.single", queue="billing", concurrency=1)
    add_ready_runs(definition, 50)

    leases = run_in_threads(
        8,
        lambda i: claim(
            queues=["billing"],
            max_runs=5,
            worker_id=f"w{i}",
            lease_seconds=60,
            team_ids=[team_a.pk],
        ),
    )
    assert sum(len(batch) for batch in leases) == 1
    assert len(stored(Run, definition=definition.pk, state="leased")) == 1


@pytest.mark.parametrize("how", ["complete", "fail", "expire"])
def test_concurrency_slot_frees_exactly_once(team_a, how):
    definition = make_definition(team_a, "billing.single", queue="billing", concurrency=1)
    add_ready_runs(definition, 10)
    (held,) = claim(
        queues=["billing"], max_runs=5, worker_id="w0", lease_seconds=60, team_ids=[team_a.pk]
    )
    assert (
        claim(
            queues=["billing"], max_runs=5, worker_id="w1", lease_seconds=60, team_ids=[team_a.pk]
        )
        == []
    )

    if how == "complete":
        assert (
            store.complete([(held.id, held.fencing_token, None)], team_ids=[team_a.pk])[0].status
            == 200
        )
    elif how == "fail":
        assert (
            store.fail(
                [(held.id, held.fencing_token, {"message": "x"}, True)], team_ids=[team_a.pk]
            )[0].status
            == 200
        )
    else:
        expire_lease(held.id)
        assert len(store.reap()) == 1
    # A second finish with the same token changes nothing and frees nothing more.
    assert (
        store.complete([(held.id, held.fencing_token, None)], team_ids=[team_a.pk])[0].status == 409
    )
    assert store.reap() == []

    leases = run_in_threads(
        8,
        lambda i: claim(
            queues=["billing"],
            max_runs=5,
            worker_id=f"w{i}",
            lease_seconds=60,
            team_ids=[team_a.pk],
        ),
    )
    assert sum(len(batch) for batch in leases) == 1
    assert len(stored(Run, definition=definition.pk, state="leased")) == 1


def test_definition_at_its_limit_is_skipped_not_waited_on(team_a):
    limited = make_definition(team_a, "etl.limited", queue="etl", concurrency=1)
    free = make_definition(team_a, "etl.free", queue="etl")
    add_ready_runs(limited, 5, age_seconds=10)
    add_ready_runs(free, 5, age_seconds=5)
    first = claim(
        queues=["etl"], max_runs=10, worker_id="w", lease_seconds=60, team_ids=[team_a.pk]
    )
    assert Counter(lease.job for lease in first) == {"etl.limited": 1, "etl.free": 5}


def test_paused_definition_and_paused_queue_are_not_claimed(team_a):
    from apps.jobs.models import Queue

    paused = make_definition(team_a, "ops.paused", queue="ops", paused=True)
    other = make_definition(team_a, "ops.other", queue="ops-2")
    add_ready_runs(paused, 3)
    add_ready_runs(other, 3)
    Queue.objects.create(team=team_a, name="ops-2", paused=True)
    assert claim(queues=["ops", "ops-2"], max_runs=10, worker_id="w", lease_seconds=60) == []


def test_runs_not_yet_available_are_not_claimed(team_a):
    from datetime import timedelta

    from apps.runs import shards
    from apps.runs.store import NewRun, insert_runs
    from tests.conftest import db_now

    definition = make_definition(team_a, "later.job", queue="later")
    later = db_now() + timedelta(hours=1)
    with shards.using(shards.alias_of_shard(definition.shard)):
        insert_runs([NewRun(definition.pk, "api", later, later, "k")])
    assert claim(queues=["later"], max_runs=10, worker_id="w", lease_seconds=60) == []


def test_a_requeue_and_a_discard_of_the_same_dead_runs_at_once_do_not_deadlock(team_a):
    """Each locked the runs in the order its plan read them (the requeue's join with the
    definitions, the discard's index): an operator's requeue and another's discard of one
    dead-letter queue each held runs the other waited for, and the deadlock detector failed
    one (a 503). They lock in id order now: one waits for the other, and each run is
    requeued or discarded, once."""
    from apps.audit.record import Actor
    from apps.runs import shards, transitions

    definition = make_definition(team_a, "load.dead", queue="dead", retry_max_attempts=1)
    alias = shards.alias_of_shard(definition.shard)
    for round_ in range(3):
        ids = add_ready_runs(definition, 1000, prefix=f"dead-{round_}")
        with connections[alias].cursor() as cursor:
            # Written last to first: the table's order is the reverse of the ids'.
            cursor.executemany(
                "UPDATE runs_run SET state = 'dead' WHERE id = %s", [[pk] for pk in ids[::-1]]
            )
        with shards.using(alias):
            runs = list(Run.objects.filter(pk__in=ids))

        def act(i: int, runs: list = runs) -> list:
            if i % 2:  # this one's plan reads the table in its order, the others by the index
                with connections[alias].cursor() as cursor:
                    cursor.execute("SET enable_indexscan = off; SET enable_bitmapscan = off")
            action = transitions.requeue if i % 2 else transitions.discard
            return action(runs, Actor.system())

        done = run_in_threads(6, act)
        requeued = sum(len(made) for i, made in enumerate(done) if i % 2)
        discarded = sum(len(made) for i, made in enumerate(done) if not i % 2)
        assert requeued + discarded == 1000
        with shards.using(alias):
            states = Counter(Run.objects.filter(pk__in=ids).values_list("state", flat=True))
        assert states == Counter(ready=requeued, cancelled=discarded)
