"""Weighted priorities (70/25/5) and round-robin between teams within a priority."""

from __future__ import annotations

from collections import Counter

import pytest

from apps.runs import shards
from apps.runs.fairness import PATTERN, interleave_teams
from tests.conftest import add_ready_runs, claim, make_definition, names_on_one_database

pytestmark = [pytest.mark.shards, pytest.mark.django_db(transaction=True, databases="__all__")]


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
        (lease,) = claim(queues=["shared"], max_runs=1, worker_id=f"w{i}")
        served.append(lease.job)
    assert served.count("b.bulk") == 10


def test_batched_claims_are_round_robin_across_teams(team_a, team_b):
    big = make_definition(team_a, "a.bulk", queue="shared", priority="bulk")
    small = make_definition(team_b, "b.bulk", queue="shared", priority="bulk")
    add_ready_runs(big, 200, age_seconds=60)
    add_ready_runs(small, 10, age_seconds=1)
    batch = claim(queues=["shared"], max_runs=20, worker_id="w")
    served = Counter(lease.job for lease in batch)
    if shards.alias_of_shard(big.shard) == shards.alias_of_shard(small.shard):
        assert served == {"a.bulk": 10, "b.bulk": 10}
    else:
        # Across databases each gives its share of the batch first (apps/runs/leasing.py).
        share = -(-20 // len(shards.databases()))
        assert sum(served.values()) == 20 and served["b.bulk"] >= min(10, share)


def test_single_claims_split_seventy_twenty_five_five(team_a):
    # The weights hold within a database: with shards on servers of their own, these three jobs
    # are named so that they share one (README, "Scale beyond one database").
    names = dict(zip(("critical", "default", "bulk"), names_on_one_database("mix", 3), strict=True))
    for priority, name in names.items():
        definition = make_definition(team_a, name, queue="mix", priority=priority)
        add_ready_runs(definition, 1000)
    served = Counter()
    # Twenty turns of the 20-slot pattern (single claims on three databases took 14 s for 1 000).
    for i in range(400):
        (lease,) = claim(queues=["mix"], max_runs=1, worker_id=f"w{i % 8}")
        served[lease.job] += 1
    assert abs(served[names["critical"]] / 4 - 70) <= 5
    assert abs(served[names["default"]] / 4 - 25) <= 5
    assert abs(served[names["bulk"]] / 4 - 5) <= 5


def test_a_priority_without_work_yields_its_share(team_a):
    definition = make_definition(team_a, "only.bulk", queue="mix", priority="bulk")
    add_ready_runs(definition, 30)
    batch = claim(queues=["mix"], max_runs=20, worker_id="w")
    assert len(batch) == 20
