"""Prometheus metrics of runs, counted as the processes lease, finish and reap them.

With PROMETHEUS_MULTIPROC_DIR set (the dev command sets it; production sets it per host), every
process (web workers, scheduler) writes its counters there and /metrics (apps/ops/metrics.py)
adds them up; without it, each process reports its own.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Sequence

from prometheus_client import Counter, Histogram

from apps.runs.models import PRIORITY_NAMES
from apps.teams.models import Team

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)

RUNS_STARTED = Counter(
    "scheduler_runs_started_total", "Runs leased to a worker.", ["queue", "priority"]
)
RUNS_SUCCEEDED = Counter("scheduler_runs_succeeded_total", "Runs completed.", ["queue"])
RUNS_FAILED = Counter(
    "scheduler_runs_failed_total", "Failed attempts (fail calls and reaped leases).", ["queue"]
)
RUNS_DEAD = Counter(
    "scheduler_runs_dead_total", "Runs that reached the dead-letter queue.", ["queue"]
)
LEASE_EXPIRATIONS = Counter(
    "scheduler_lease_expirations_total",
    "Leases reaped: lease_expired or timed_out.",
    ["queue", "outcome"],
)
STALE_TOKENS = Counter(
    "scheduler_stale_token_rejections_total",
    "Heartbeats, completions and failures refused with 409.",
    ["call"],
)
# Lateness is labelled by team as well as queue: teams may share a queue name, and one team's
# late runs must not move another team's alert.
DUE_TO_START = Histogram(
    "scheduler_due_to_start_seconds",
    "From a run's availableAt (due time plus jitter, or end of backoff) to its lease.",
    ["queue", "priority", "team"],
    buckets=LATENCY_BUCKETS,
)
LATE_RUNS = Counter(
    "scheduler_late_runs_total",
    "Runs that started later than their definition's lateness SLO.",
    ["queue", "team"],
)
CLAIM_BATCH = Histogram(
    "scheduler_claim_batch_size", "Runs handed out per lease call.", buckets=BATCH_BUCKETS
)


def observe_claim(leases: Sequence) -> None:
    # One labels lookup per (queue, priority) of the batch, not per run: at batch 100 the
    # lookups cost more than the counting.
    CLAIM_BATCH.observe(len(leases))
    groups: dict[tuple[int, str, int], list] = {}
    for lease in leases:
        groups.setdefault((lease.team_id, lease.queue, lease.priority), []).append(lease)
    for (team_id, queue, priority), group in groups.items():
        name = PRIORITY_NAMES[priority]
        team = team_label(team_id)
        RUNS_STARTED.labels(queue, name).inc(len(group))
        observe_many(
            DUE_TO_START.labels(queue, name, team),
            [max(0.0, (lease.leased_at - lease.available_at).total_seconds()) for lease in group],
        )
        late = sum(1 for lease in group if lease.late)
        if late:
            LATE_RUNS.labels(queue, team).inc(late)


_team_labels: dict[int, str] = {}


def team_label(team_id: int) -> str:
    """A team's slug for metric labels, read once per process (slugs do not change)."""
    label = _team_labels.get(team_id)
    if label is None:
        slug = Team.objects.filter(pk=team_id).values_list("slug", flat=True).first()
        label = slug or str(team_id)
        if slug is not None:
            _team_labels[team_id] = label
    return label


def observe_many(child: Histogram, amounts: Sequence[float]) -> None:
    """`child.observe(a) for a in amounts`, with one write per bucket instead of one per amount.

    In multiprocess mode every write goes to a memory-mapped file; a claim of 100 runs made
    200 of them. Uses the client's bucket fields (pinned in pyproject.toml; tests compare it
    with `observe`)."""
    if not amounts:
        return
    bounds = child._upper_bounds
    counts = collections.Counter(bisect.bisect_left(bounds, amount) for amount in amounts)
    child._sum.inc(sum(amounts))
    for index, count in counts.items():
        child._buckets[index].inc(count)


def observe_results(outcomes: Iterable, call: str) -> None:
    """Count the outcomes of heartbeat, complete or fail items."""
    counts: collections.Counter[tuple[Counter, str]] = collections.Counter()
    for outcome in outcomes:
        if outcome.status == 409:
            # A cancel asked for, or a lease that expired with its token still the run's (the
            # reaper counts the expiry): not a stale token.
            if outcome.code not in ("cancelled", "lease-expired"):
                counts[STALE_TOKENS, call] += 1
        elif outcome.status == 200 and call != "heartbeat" and outcome.state != "cancelled":
            if outcome.state == "succeeded":
                counts[RUNS_SUCCEEDED, outcome.queue] += 1
            else:
                counts[RUNS_FAILED, outcome.queue] += 1
                if outcome.state == "dead":
                    counts[RUNS_DEAD, outcome.queue] += 1
    for (metric, label), n in counts.items():
        metric.labels(label).inc(n)


def observe_reaped(reaped: Iterable) -> None:
    for item in reaped:
        LEASE_EXPIRATIONS.labels(item.queue, item.outcome).inc()
        if item.state == "cancelled":
            continue  # a cancel the worker never reported: it ends as asked, not as a failure
        RUNS_FAILED.labels(item.queue).inc()
        if item.state == "dead":
            RUNS_DEAD.labels(item.queue).inc()
