"""Which priority each claim slot serves: critical 70 %, default 25 %, bulk 5 % when all have work.

The weights are served as a fixed pattern of 20 slots, interleaved the way smooth weighted
round-robin interleaves them, so short runs of claims are as close to the ratio as long ones. A
shared database sequence (`runs_claim_tick`) says where in the pattern each claim starts, so
claims from many workers and processes together follow the pattern without coordinating.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

WEIGHTS = {0: 14, 1: 5, 2: 1}  # priority -> slots out of 20 (70/25/5)


def _smooth_pattern(weights: dict[int, int]) -> tuple[int, ...]:
    total = sum(weights.values())
    current = dict.fromkeys(weights, 0)
    pattern = []
    for _ in range(total):
        for key, weight in weights.items():
            current[key] += weight
        best = max(current, key=lambda key: (current[key], -key))
        current[best] -= total
        pattern.append(best)
    return tuple(pattern)


PATTERN = _smooth_pattern(WEIGHTS)


def interleave_teams(rows: Sequence[T], team_of, tick: int) -> list[T]:
    """Order one priority's candidates round-robin across teams, oldest first within a team.

    1. Group the rows (already oldest first) by team.
    2. Rotate the team order by `tick`, so the team served first changes from claim to claim.
    3. Take one row from each team in turn until all are taken.
    """
    by_team: dict[object, list[T]] = {}
    for row in rows:
        by_team.setdefault(team_of(row), []).append(row)
    if len(by_team) == 1:
        return list(rows)
    teams = sorted(by_team, key=str)
    if not teams:
        return []
    start = tick % len(teams)
    teams = teams[start:] + teams[:start]
    ordered: list[T] = []
    depth = 0
    while len(ordered) < len(rows):
        for team in teams:
            queue = by_team[team]
            if depth < len(queue):
                ordered.append(queue[depth])
        depth += 1
    return ordered


def slot_priorities(tick: int, count: int) -> Iterable[int]:
    """Yield the preferred priority of each of `count` slots of the claim numbered `tick`."""
    start = tick * count
    for i in range(count):
        yield PATTERN[(start + i) % len(PATTERN)]
