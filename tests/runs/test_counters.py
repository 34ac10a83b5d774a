"""Per-minute counters: written by the statements that lease and end attempts, read by the
overview; exact under concurrent batches, and equal to a recount from the attempts."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection

from apps.dashboard import queries
from apps.runs import counters, store
from apps.runs.models import MinuteCounts
from tests.conftest import add_ready_runs, db_now, expire_lease, make_definition
from tests.runs.test_claim_concurrency import run_in_threads

pytestmark = pytest.mark.django_db(transaction=True)


def totals(team_id: int) -> Counter:
    total: Counter = Counter()
    for row in MinuteCounts.objects.filter(team_id=team_id):
        total.update(
            started=row.started, succeeded=row.succeeded, failed=row.failed, first=sum(row.latency)
        )
    return total


def per_lane_minute() -> dict[tuple, tuple]:
    """Counts per (minute, team, queue, priority), summed over slots."""
    summed: dict[tuple, list] = {}
    for row in MinuteCounts.objects.all():
        key = (row.minute, row.team_id, row.queue, row.priority)
        entry = summed.setdefault(key, [0, 0, 0, [0] * (len(counters.LATENCY_BOUNDS) + 1)])
        entry[0] += row.started
        entry[1] += row.succeeded
        entry[2] += row.failed
        for i, n in enumerate(row.latency):
            entry[3][i] += n
    return {key: (a, b, c, tuple(d)) for key, (a, b, c, d) in summed.items()}


def claim(team, queue: str, n: int) -> list[store.Lease]:
    return store.claim(
        queues=[queue], max_runs=n, worker_id="w", lease_seconds=60, team_ids=[team.pk]
    )


def test_leases_completions_failures_and_reaps_are_counted(team_a, team_b):
    definition = make_definition(team_a, "count.me", queue="counted", retry_max_attempts=3)
    add_ready_runs(definition, 4)
    first, second, third, fourth = claim(team_a, "counted", 4)
    store.complete([(first.id, first.fencing_token, None)], team_ids=[team_a.pk])
    store.fail([(second.id, second.fencing_token, {"message": "boom"}, True)], team_ids=[team_a.pk])
    expire_lease(third.id)
    store.reap()
    # A refused completion (stale token) counts nothing.
    store.complete([(fourth.id, fourth.fencing_token + 1000, None)], team_ids=[team_a.pk])

    assert totals(team_a.pk) == Counter(started=4, succeeded=1, failed=2, first=4)
    assert totals(team_b.pk) == Counter()
    (lane,) = {(row.queue, row.priority) for row in MinuteCounts.objects.all()}
    assert lane == ("counted", definition.priority)

    # The retried runs' second attempts are started, but only first attempts have a latency.
    MinuteCounts.objects.update(minute=db_now() - timedelta(minutes=5))
    with connection.cursor() as cursor:
        cursor.execute("UPDATE runs_run SET available_at = now() - interval '1 second'")
    again = claim(team_a, "counted", 4)
    assert sorted((lease.id, lease.attempt) for lease in again) == [(second.id, 2), (third.id, 2)]
    assert totals(team_a.pk) == Counter(started=6, succeeded=1, failed=2, first=4)


def test_first_attempts_are_bucketed_by_their_due_to_start_delay(team_a):
    definition = make_definition(team_a, "late.ones", queue="late")
    add_ready_runs(definition, 2, prefix="quick", age_seconds=0.3)
    add_ready_runs(definition, 1, prefix="slow", age_seconds=20)
    claim(team_a, "late", 3)

    (row,) = MinuteCounts.objects.all()
    bounds = counters.LATENCY_BOUNDS
    # 0.3 s falls in (0.25, 0.5]; 20 s in (10, 30].
    assert row.latency[bounds.index(0.5)] == 2
    assert row.latency[bounds.index(30)] == 1
    assert sum(row.latency) == 3


def test_concurrent_batches_lose_no_count_and_do_not_deadlock(team_a, team_b):
    """Eight threads, each its own connection, claim and finish batches of two teams' runs at
    once: every counter update lands, however the batches interleave."""
    for team in (team_a, team_b):
        for queue in ("left", "right"):
            add_ready_runs(make_definition(team, f"{team.slug}.{queue}", queue=queue), 300)
    teams = [team_a.pk, team_b.pk]

    def worker(index: int) -> Counter:
        done: Counter = Counter()
        while leases := store.claim(
            queues=["left", "right"],
            max_runs=7,
            worker_id=f"w{index}",
            lease_seconds=60,
            team_ids=teams,
        ):
            items = [(lease.id, lease.fencing_token) for lease in leases]
            half = len(items) // 2
            store.complete([(i, t, None) for i, t in items[:half]], team_ids=teams)
            store.fail([(i, t, {"message": "no"}, False) for i, t in items[half:]], team_ids=teams)
            done.update(succeeded=half, failed=len(items) - half)
        return done

    done = sum(run_in_threads(8, worker), Counter())
    assert done["succeeded"] + done["failed"] == 1200
    counted = totals(team_a.pk) + totals(team_b.pk)
    assert counted == Counter(
        started=1200, succeeded=done["succeeded"], failed=done["failed"], first=1200
    )


def test_a_rebuild_from_the_attempts_gives_the_same_counts(team_a):
    definition = make_definition(team_a, "rebuilt", queue="rebuilt", retry_max_attempts=2)
    add_ready_runs(definition, 6, age_seconds=3)
    leases = claim(team_a, "rebuilt", 6)
    store.complete([(x.id, x.fencing_token, None) for x in leases[:3]], team_ids=[team_a.pk])
    store.fail(
        [(x.id, x.fencing_token, {"message": "x"}, True) for x in leases[3:]], team_ids=[team_a.pk]
    )
    live = per_lane_minute()
    assert live

    MinuteCounts.objects.all().delete()
    assert counters.rebuild(hours=1) == len(live)
    assert per_lane_minute() == live


def test_old_counters_are_deleted(team_a):
    now = db_now()
    for hours in (1, counters.KEEP_HOURS + 1):
        MinuteCounts.objects.create(
            minute=now - timedelta(hours=hours),
            team=team_a,
            queue="q",
            priority=1,
            slot=0,
            succeeded=1,
        )
    assert counters.delete_old() == 1
    assert MinuteCounts.objects.get().minute == now - timedelta(hours=1)


def test_the_overview_reads_its_windows_from_the_counters(team_a, team_b):
    now = db_now().replace(second=30)
    minute = now.replace(second=0, microsecond=0)

    def add(team, ago: timedelta, slot: int, **counts) -> None:
        MinuteCounts.objects.create(
            minute=minute - ago, team=team, queue="q", priority=1, slot=slot, **counts
        )

    buckets = [0] * (len(counters.LATENCY_BOUNDS) + 1)
    buckets[1] = 10  # all in (0.01, 0.025]
    add(team_a, timedelta(0), 0, started=10, succeeded=7, failed=1, latency=buckets)
    add(team_a, timedelta(0), 3, succeeded=2, failed=1)
    add(team_a, timedelta(minutes=30), 0, failed=4)
    add(team_a, timedelta(hours=5), 0, failed=5)  # in the day, not the hour
    add(team_a, timedelta(hours=30), 0, failed=100)  # older than the day
    add(team_b, timedelta(0), 0, failed=1000)  # another team

    stats = queries.overview([team_a.pk], now)
    assert stats.failures_24h == 1 + 1 + 4 + 5
    per_minute = {at: (ok, bad) for at, ok, bad in stats.per_minute}
    assert per_minute[minute] == (9, 2)
    assert per_minute[minute - timedelta(minutes=30)] == (0, 4)
    assert sum(ok + bad for ok, bad in per_minute.values()) == 15
    assert stats.counts["succeeded"] == 9  # of the last 24 hours
    (latency,) = stats.latency
    assert latency["n"] == 10 and latency["queue"] == "q"
    assert latency["p50"] == pytest.approx(0.0175)


def test_quantiles_interpolate_within_their_bucket():
    counts = [0] * (len(counters.LATENCY_BOUNDS) + 1)
    assert counters.quantile(counts, 0.5) is None
    counts[0], counts[2] = 50, 50  # (0, 0.01] and (0.025, 0.05]
    assert counters.quantile(counts, 0.25) == pytest.approx(0.005)
    assert counters.quantile(counts, 0.99) == pytest.approx(0.025 + 0.025 * 0.98)
    counts[-1] = 1000  # above every bound: reported as the last bound
    assert counters.quantile(counts, 0.99) == counters.LATENCY_BOUNDS[-1]
