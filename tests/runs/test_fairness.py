"""Weighted priorities (70/25/5) and round-robin between teams within a priority."""

from __future__ import annotations

from collections import Counter

import pytest

from apps.runs import store
from apps.runs.fairness import PATTERN, interleave_teams
from tests.conftest import add_ready_runs, make_definition

pytestmark = pytest.mark.django_db(transaction=True)


def test_pattern_has_the_weights():
    assert Counter(PATTERN) == {0: 14, 1: 5, 2: 1}


def test_interleave_alternates_teams():
    rows = [("a", 1), ("a", 2), ("a", 3), ("b", 1)]
    ordered = interleave_teams(rows, lambda row: row[0], tick=0)
    assert ordered == [("a", 1), ("b", 1), ("a", 2), ("a", 3)]


def test_small_team_is_not_starved_by_a_big_one(team_a, team_b):
    big = make_definition(team_a, "a.bulk", queue="shared", priority="bulk")
    small = make_definition(team_b, "b.bulk", queue="shared", priority="bulk")
    add_ready_runs(big, 1000, age_seconds=60)  # older: a FIFO queue would serve all of these first
    add_ready_runs(small, 10, age_seconds=1)
    served = []
    for i in range(40):
        (lease,) = store.claim(queues=["shared"], max_runs=1, worker_id=f"w{i}", lease_seconds=60)
        served.append(lease.job)
    assert served.count("b.bulk") == 10


def test_batched_claims_are_round_robin_across_teams(team_a, team_b):
    big = make_definition(team_a, "a.bulk", queue="shared", priority="bulk")
    small = make_definition(team_b, "b.bulk", queue="shared", priority="bulk")
    add_ready_runs(big, 200, age_seconds=60)
    add_ready_runs(small, 10, age_seconds=1)
    batch = store.claim(queues=["shared"], max_runs=20, worker_id="w", lease_seconds=60)
    assert Counter(lease.job for lease in batch) == {"a.bulk": 10, "b.bulk": 10}


def test_single_claims_split_seventy_twenty_five_five(team_a):
    for priority in ("critical", "default", "bulk"):
        definition = make_definition(team_a, f"mix.{priority}", queue="mix", priority=priority)
        add_ready_runs(definition, 1000)
    served = Counter()
    for i in range(1000):
        (lease,) = store.claim(queues=["mix"], max_runs=1, worker_id=f"w{i % 8}", lease_seconds=60)
        served[lease.job] += 1
    assert abs(served["mix.critical"] / 10 - 70) <= 5
    assert abs(served["mix.default"] / 10 - 25) <= 5
    assert abs(served["mix.bulk"] / 10 - 5) <= 5


def test_a_priority_without_work_yields_its_share(team_a):
    definition = make_definition(team_a, "only.bulk", queue="mix", priority="bulk")
    add_ready_runs(definition, 30)
    batch = store.claim(queues=["mix"], max_runs=20, worker_id="w", lease_seconds=60)
    assert len(batch) == 20
