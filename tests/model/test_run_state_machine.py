"""Model-based test of the run state machine against the real database.

A Hypothesis `RuleBasedStateMachine` drives the worker transitions of `apps.runs.store` (claim,
heartbeat, complete, fail, reap) and the people's transitions of `apps.runs.transitions` (cancel,
retry, requeue, discard) on a handful of real rows, plus two ways of moving time: expiring one
lease, and advancing the whole clock. The database clock cannot be moved, so time is modelled by
shifting every deadline of the rows (`available_at`, `lease_expires_at`, `timeout_at`) into the
past by the same interval, in the database and in the model alike.

Flow control is modelled too: `model.rated` may start at most RATE_COUNT leases in any window
of RATE_PERIOD seconds (the window's starts are shifted with the clock), and `model.keyed` at
most one leased run per concurrency key.

After every step each run's state, attempt, maxAttempts, fencing token and deadlines in the
database must equal the model's, and its attempts must be one per issued token. Along the way:
stale tokens get 409 and change nothing, tokens only grow (per run and across runs), attempts never
pass maxAttempts between requeues, no token is handed out twice, a run is `dead` only after its
last attempt or a non-retryable failure, and a cancelled run is never leased again.

Backoff is random (full jitter), so a failed run's `availableAt` is checked to lie within its
bounds and then adopted by the model. Where a deadline falls between the clock readings taken
just before and just after a statement (a few milliseconds), either outcome is accepted.

Isolation: every Hypothesis example starts from empty tables (TRUNCATE … CASCADE in
`initialize`), inside one `transaction=True` test, so each statement commits and `now()` moves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import pairwise

import pytest
from django.db import connection
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from apps.audit.record import Actor
from apps.runs import store, transitions
from apps.runs.models import Run
from apps.runs.store import NewRun, insert_runs
from apps.teams.models import Team
from tests.conftest import make_definition

LEASE_SECONDS = 300  # long enough that only the model's own clock moves expire a lease
TIMEOUT_SECONDS = 900  # every definition's timeoutSeconds: the attempt's hard deadline
WAITING = ("scheduled", "ready", "retrying")
ACTOR = Actor.system("model-test")

# Bounded so the whole test stays well under a minute on a 2-core CI machine; raise the numbers
# locally (MODEL_MAX_EXAMPLES=500 MODEL_STEPS=60) for a deeper search.
MODEL_SETTINGS = settings(
    max_examples=int(os.environ.get("MODEL_MAX_EXAMPLES", "30")),
    stateful_step_count=int(os.environ.get("MODEL_STEPS", "30")),
    deadline=None,
    database=None,  # no .hypothesis/ folder in the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# name, queue, priority, concurrency. Retry policies are drawn per example.
# `model.limited` and `model.free` share a claim lane (team, queue, priority): a limited
# definition at its limit must not hold back the other definition's runs; nor must a spent rate
# limit (`model.rated`) or a key at its limit (`model.keyed`).
DEFINITIONS = (
    ("model.limited", "q", "default", 1),
    ("model.free", "q", "default", None),
    ("model.urgent", "q", "critical", None),
    ("model.bulk", "other", "bulk", None),
    ("model.rated", "q", "default", None),
    ("model.keyed", "q", "default", None),
)
RATE_COUNT, RATE_PERIOD = 2, 30
KEYS = ("k1", "k2")
QUEUE_CHOICES = (("q",), ("other",), ("q", "other"))


@dataclass
class Policy:
    max_attempts: int
    base_seconds: int
    max_seconds: int
    concurrency: int | None
    queue: str

    def backoff_bound(self, attempt: int) -> float:
        """The longest backoff before retry `attempt` (1-based): full jitter's upper bound."""
        return float(min(self.max_seconds, self.base_seconds * 2 ** min(attempt - 1, 40)))


@dataclass
class RunModel:
    pk: int
    definition: str
    state: str
    available_at: datetime
    max_attempts: int
    attempt: int = 0
    token: int | None = None
    lease_expires_at: datetime | None = None
    timeout_at: datetime | None = None
    tokens: list[int] = field(default_factory=list)  # every token this run was leased with
    cancel_requested: bool = False  # cancelled while leased: whatever comes next ends it
    key: str | None = None  # the concurrency key (model.keyed's runs)

    def row(self) -> tuple:
        return (
            self.state,
            self.attempt,
            self.max_attempts,
            self.token,
            self.available_at,
            self.lease_expires_at,
            self.timeout_at,
            self.cancel_requested,
        )


def db_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def passed(moment: datetime, before: datetime, after: datetime) -> bool | None:
    """Had `moment` passed for a statement run between the clock readings `before` and `after`?

    True or False when certain; None when it lies between the two readings.
    """
    if moment <= before:
        return True
    if moment > after:
        return False
    return None


class RunStateMachine(RuleBasedStateMachine):
    """The in-memory model: one RunModel per run of team A, and every token ever issued."""

    @initialize(
        data=st.data(),
        run_count=st.integers(min_value=2, max_value=8),
    )
    def set_up(self, data, run_count: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "TRUNCATE runs_attempt, runs_run, runs_ratestart, jobs_jobdefinition, jobs_queue, "
                "audit_auditevent, teams_team CASCADE"
            )
        self.team = Team.objects.create(slug="model-a", name="Model A")
        # Another team, to show that a team's token cannot touch team A's runs (404).
        self.other_team = Team.objects.create(slug="model-b", name="Model B")
        self.policies: dict[str, Policy] = {}
        self.definitions = {}
        for name, queue, priority, concurrency in DEFINITIONS:
            policy = Policy(
                max_attempts=data.draw(st.integers(2, 3), label=f"{name} maxAttempts"),
                base_seconds=data.draw(st.sampled_from([0, 1]), label=f"{name} baseSeconds"),
                max_seconds=2,
                concurrency=concurrency,
                queue=queue,
            )
            self.policies[name] = policy
            limits = {}
            if name == "model.rated":
                limits = {"rate_limit_count": RATE_COUNT, "rate_limit_period_seconds": RATE_PERIOD}
            elif name == "model.keyed":
                limits = {"concurrency_per_key": 1}
            self.definitions[name] = make_definition(
                self.team,
                name,
                queue=queue,
                priority=priority,
                concurrency=concurrency,
                timeout_seconds=TIMEOUT_SECONDS,
                retry_max_attempts=policy.max_attempts,
                retry_base_seconds=policy.base_seconds,
                retry_max_seconds=policy.max_seconds,
                **limits,
            )
        now = db_now()
        new_runs = []
        names = []
        for index in range(run_count):
            name = data.draw(st.sampled_from([d[0] for d in DEFINITIONS]), label=f"run {index}")
            # Claimable now, or due in 30 s (the clock-advance rule makes it claimable).
            offset = data.draw(st.sampled_from([-1, 30]), label=f"run {index} offset")
            at = now + timedelta(seconds=offset) + timedelta(microseconds=index)
            key = None
            if name == "model.keyed":
                key = data.draw(st.sampled_from(KEYS), label=f"run {index} key")
            new_runs.append(
                NewRun(
                    self.definitions[name].pk, "api", at, at, f"model-{index}", concurrency_key=key
                )
            )
            names.append(name)
        ids = insert_runs(new_runs)
        assert len(ids) == run_count
        self.runs: list[RunModel] = [
            RunModel(
                pk=pk,
                definition=name,
                state="scheduled",
                available_at=new.available_at,
                max_attempts=self.policies[name].max_attempts,
                key=new.concurrency_key,
            )
            for pk, name, new in zip(ids, names, new_runs, strict=True)
        ]
        self.by_pk = {run.pk: run for run in self.runs}
        self.issued: list[int] = []  # every token issued in this example, in order
        # model.rated's lease starts: (earliest, latest) database time of each claim that took
        # them, one pair per lease, shifted with the clock.
        self.rated_starts: list[tuple[datetime, datetime]] = []

    # --- helpers ------------------------------------------------------------------------------

    def pick(self, index: int) -> RunModel:
        return self.runs[index % len(self.runs)]

    def choose_token(self, run: RunModel, kind: str, index: int) -> int:
        """The run's current token, any token issued so far, or one never issued."""
        if kind == "current" and run.token is not None:
            return run.token
        if kind in ("current", "issued") and self.issued:
            return self.issued[index % len(self.issued)]
        return (max(self.issued) if self.issued else 0) + 1 + index

    def leased(self) -> list[RunModel]:
        return [run for run in self.runs if run.state == "leased"]

    def fetch(self, pk: int) -> tuple:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT state, attempt, max_attempts, fencing_token, available_at, "
                "lease_expires_at, timeout_at FROM runs_run WHERE id = %s",
                [pk],
            )
            return cursor.fetchone()

    def after_failure(
        self, run: RunModel, retryable: bool, new_state: str, available_at, before, after
    ) -> None:
        """Check and apply a failed attempt (worker fail or reaper): retrying or dead, or
        cancelled when a cancel was asked for while it was leased (never retried)."""
        if run.cancel_requested:
            assert new_state == "cancelled", (run, new_state)
            assert available_at == run.available_at  # unchanged
            run.state = new_state
            run.lease_expires_at = None
            return
        policy = self.policies[run.definition]
        expect_retry = retryable and run.attempt < run.max_attempts
        assert new_state == ("retrying" if expect_retry else "dead"), (run, retryable, new_state)
        if new_state == "dead":
            # The DLQ only after the last attempt, or on an error the worker called final.
            assert not retryable or run.attempt >= run.max_attempts
            assert available_at == run.available_at  # unchanged
        else:
            bound = timedelta(seconds=policy.backoff_bound(run.attempt))
            assert before <= available_at <= after + bound, (available_at, before, after, bound)
            run.available_at = available_at
        run.state = new_state
        run.lease_expires_at = None

    # --- worker transitions (apps.runs.store) ---------------------------------------------------

    @rule(
        max_runs=st.integers(min_value=1, max_value=8),
        queues=st.sampled_from(QUEUE_CHOICES),
    )
    def claim(self, max_runs: int, queues: tuple[str, ...]) -> None:
        before = db_now()
        leases = store.claim(
            queues=list(queues),
            max_runs=max_runs,
            worker_id="model-worker",
            lease_seconds=LEASE_SECONDS,
            team_ids=[self.team.pk],
        )
        after = db_now()
        waiting = [
            run
            for run in self.runs
            if run.state in WAITING and self.policies[run.definition].queue in queues
        ]
        due = {run.pk: passed(run.available_at, before, after) for run in waiting}
        leased_ids = [lease.id for lease in leases]
        assert len(leased_ids) == len(set(leased_ids)), "a run leased twice in one claim"
        assert len(leases) <= max_runs
        for lease in leases:
            run = self.by_pk[lease.id]
            assert run.state != "cancelled", "a cancelled run was leased"
            assert run.state in WAITING, f"leased a run that is {run.state}"
            assert due.get(run.pk) is not False, "leased a run before its availableAt"
        # Concurrency: never more leased runs of a limited definition than its limit.
        capacity: dict[str, int] = {}
        for name, policy in self.policies.items():
            if policy.concurrency is not None:
                held = sum(1 for run in self.leased() if run.definition == name)
                capacity[name] = policy.concurrency - held
                got = sum(1 for lease in leases if self.by_pk[lease.id].definition == name)
                assert got <= max(capacity[name], 0), (name, got, capacity[name])
        # The rate: the starts surely inside the window bound it; those that may have left it
        # (their time is within the statement's few milliseconds of the window's edge) make the
        # exact room unknown.
        window_start = (
            before - timedelta(seconds=RATE_PERIOD),
            after - timedelta(seconds=RATE_PERIOD),
        )
        surely_in = sum(1 for _, latest in self.rated_starts if latest > window_start[1])
        maybe_in = sum(1 for earliest, _ in self.rated_starts if earliest > window_start[0])
        rated_got = sum(1 for lease in leases if self.by_pk[lease.id].definition == "model.rated")
        assert rated_got <= max(RATE_COUNT - surely_in, 0), (rated_got, self.rated_starts)
        exact = surely_in == maybe_in
        capacity["model.rated"] = RATE_COUNT - surely_in
        # Keys: never two leased runs of one key of model.keyed.
        key_room = {
            key: 1
            - sum(1 for run in self.leased() if run.definition == "model.keyed" and run.key == key)
            for key in KEYS
        }
        keyed_got = [
            self.by_pk[lease.id].key
            for lease in leases
            if self.by_pk[lease.id].definition == "model.keyed"
        ]
        for key in KEYS:
            assert keyed_got.count(key) <= max(key_room[key], 0), (key, keyed_got, key_room)
        # Nothing claimable is left behind when the claim had room: a definition at its limit is
        # skipped, the others still served.
        if exact and all(flag is not None for flag in due.values()):
            eligible = 0
            for name in self.policies:
                due_runs = [
                    run for run in waiting if run.definition == name and due[run.pk] is True
                ]
                count = len(due_runs)
                if name == "model.keyed":
                    count = sum(
                        min(sum(1 for run in due_runs if run.key == key), max(key_room[key], 0))
                        for key in KEYS
                    )
                eligible += min(count, max(capacity[name], 0)) if name in capacity else count
            assert len(leases) == min(max_runs, eligible), (
                f"claimed {len(leases)} of {eligible} claimable runs with max={max_runs}"
            )
        # One sequence hands out every token: each of this claim's is new and above all before.
        previous = max(self.issued, default=0)
        for lease in leases:
            run = self.by_pk[lease.id]
            assert lease.attempt == run.attempt + 1
            assert lease.attempt <= run.max_attempts, "an attempt past maxAttempts"
            assert lease.max_attempts == run.max_attempts
            assert lease.fencing_token not in self.issued, "a token handed out twice"
            assert lease.fencing_token > previous, "fencing tokens went backwards"
            expires = lease.lease_expires_at
            assert before + timedelta(seconds=LEASE_SECONDS) <= expires
            assert expires <= after + timedelta(seconds=LEASE_SECONDS)
            self.issued.append(lease.fencing_token)
            run.tokens.append(lease.fencing_token)
            if run.definition == "model.rated":
                self.rated_starts.append((before, after))
            run.state = "leased"
            run.attempt = lease.attempt
            run.token = lease.fencing_token
            run.lease_expires_at = expires
            # Both deadlines come from the same now() in the claim's statement.
            run.timeout_at = expires + timedelta(seconds=TIMEOUT_SECONDS - LEASE_SECONDS)

    @rule(
        index=st.integers(0, 5),
        kind=st.sampled_from(["current", "current", "issued", "unissued"]),
        token_index=st.integers(0, 20),
    )
    def heartbeat(self, index: int, kind: str, token_index: int) -> None:
        run = self.pick(index)
        token = self.choose_token(run, kind, token_index)
        before = db_now()
        (outcome,) = store.heartbeat([(run.pk, token)], team_ids=[self.team.pk])
        after = db_now()
        holder = run.state == "leased" and token == run.token
        expired = passed(run.lease_expires_at, before, after) if holder else True
        if holder and run.cancel_requested:
            # The holder is told to stop, expired or not; a live lease is still extended (its
            # handler may run on to its end, and is reported), an expired one is not revived.
            assert (outcome.status, outcome.code) == (409, "cancelled"), outcome
            now_expires = Run.objects.get(pk=run.pk).lease_expires_at
            if expired is False:
                low = min(before + timedelta(seconds=LEASE_SECONDS), run.timeout_at)
                high = min(after + timedelta(seconds=LEASE_SECONDS), run.timeout_at)
                assert low <= now_expires <= high, (now_expires, low, high)
            elif expired is True:
                assert now_expires == run.lease_expires_at
            run.lease_expires_at = now_expires
            return
        # Only the holder is told why: its run was cancelled (above), or its lease ran out (its
        # result is still taken until the run is reaped).
        if holder and expired is True:
            assert outcome.code == "lease-expired", outcome
        elif holder and expired is None:
            assert outcome.code in ("", "lease-expired"), outcome
        else:
            assert outcome.code == "", outcome
        if holder and expired is False:
            assert outcome.status == 200, outcome
        elif expired is True:
            # Not leased, a stale or never-issued token, or a lease already run out (a heartbeat
            # does not revive it: the reaper may be handing the run on).
            assert outcome.status == 409, (outcome, run, token)
        else:
            assert outcome.status in (200, 409)  # the lease ran out during the statement
        if outcome.status == 200:
            low = min(before + timedelta(seconds=LEASE_SECONDS), run.timeout_at)
            high = min(after + timedelta(seconds=LEASE_SECONDS), run.timeout_at)
            assert low <= outcome.lease_expires_at <= high
            run.lease_expires_at = outcome.lease_expires_at

    @rule(
        index=st.integers(0, 5),
        kind=st.sampled_from(["current", "current", "issued", "unissued"]),
        token_index=st.integers(0, 20),
    )
    def complete(self, index: int, kind: str, token_index: int) -> None:
        run = self.pick(index)
        token = self.choose_token(run, kind, token_index)
        (outcome,) = store.complete([(run.pk, token, {"ok": True})], team_ids=[self.team.pk])
        # An expired lease that the reaper has not taken still completes: the token is current.
        if run.state == "leased" and token == run.token:
            assert outcome.status == 200, outcome
            expected = "cancelled" if run.cancel_requested else "succeeded"
            assert outcome.state == expected, (outcome, run)
            run.state = expected
            run.lease_expires_at = None
        else:
            assert outcome.status == 409, (outcome, run, token)

    @rule(
        index=st.integers(0, 5),
        kind=st.sampled_from(["current", "current", "issued", "unissued"]),
        token_index=st.integers(0, 20),
        retryable=st.booleans(),
    )
    def fail(self, index: int, kind: str, token_index: int, retryable: bool) -> None:
        run = self.pick(index)
        token = self.choose_token(run, kind, token_index)
        error = {"message": "boom", "type": "ModelError"}
        before = db_now()
        (outcome,) = store.fail([(run.pk, token, error, retryable)], team_ids=[self.team.pk])
        after = db_now()
        if run.state == "leased" and token == run.token:
            assert outcome.status == 200, outcome
            self.after_failure(run, retryable, outcome.state, outcome.available_at, before, after)
        else:
            assert outcome.status == 409, (outcome, run, token)

    @rule(index=st.integers(0, 5), action=st.sampled_from(["heartbeat", "complete", "fail"]))
    def other_team(self, index: int, action: str) -> None:
        """Another team's worker, even holding the current token, gets 404 and changes nothing."""
        run = self.pick(index)
        token = run.token or 1
        team_ids = [self.other_team.pk]
        if action == "heartbeat":
            (outcome,) = store.heartbeat([(run.pk, token)], team_ids=team_ids)
        elif action == "complete":
            (outcome,) = store.complete([(run.pk, token, None)], team_ids=team_ids)
        else:
            (outcome,) = store.fail([(run.pk, token, {}, True)], team_ids=team_ids)
        assert outcome.status == 404, outcome

    @precondition(lambda self: any(run.state == "leased" for run in self.runs))
    @rule(index=st.integers(0, 5), deadline=st.booleans())
    def expire(self, index: int, deadline: bool) -> None:
        """A worker stops heartbeating: its lease (and with `deadline`, its attempt) runs out."""
        leased = self.leased()
        run = leased[index % len(leased)]
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE runs_run SET lease_expires_at = now() - interval '1 second', "
                "timeout_at = CASE WHEN %s THEN now() - interval '1 second' ELSE timeout_at END "
                "WHERE id = %s RETURNING lease_expires_at, timeout_at",
                [deadline, run.pk],
            )
            run.lease_expires_at, run.timeout_at = cursor.fetchone()

    @rule()
    def reap(self) -> None:
        before = db_now()
        reaped = {item.id: item for item in store.reap()}
        after = db_now()
        for run in self.runs:
            if run.state != "leased":
                assert run.pk not in reaped, f"reaped a run that is {run.state}"
                continue
            expired = passed(run.lease_expires_at, before, after)
            if expired is True:
                assert run.pk in reaped, "an expired lease was not reaped"
            elif expired is False:
                assert run.pk not in reaped, "a live lease was reaped"
            if run.pk not in reaped:
                continue
            item = reaped[run.pk]
            timed_out = passed(run.timeout_at, before, after)
            if timed_out is not None:
                assert item.outcome == ("timed_out" if timed_out else "lease_expired"), item
            state, _, _, _, available_at, _, _ = self.fetch(run.pk)
            assert state == item.state
            self.after_failure(run, True, item.state, available_at, before, after)

    # --- people's transitions (apps.runs.transitions) -------------------------------------------

    def load(self, run: RunModel) -> Run:
        return Run.objects.select_related("team", "definition").get(pk=run.pk)

    def now_set(self, run: RunModel, before: datetime, after: datetime) -> None:
        """The transition set availableAt to now(): check it, and adopt it."""
        available_at = self.fetch(run.pk)[4]
        assert before <= available_at <= after
        run.available_at = available_at

    @rule(index=st.integers(0, 5))
    def cancel(self, index: int) -> None:
        """Cancel: a waiting run at once; a leased one is asked (once) to stop."""
        run = self.pick(index)
        changed = transitions.cancel([self.load(run)], ACTOR)
        if run.state in WAITING:
            assert [r.pk for r in changed] == [run.pk]
            run.state = "cancelled"
        elif run.state == "leased" and not run.cancel_requested:
            assert [r.pk for r in changed] == [run.pk]
            run.cancel_requested = True
        else:
            assert changed == [], f"cancelled a run that was {run.state}"

    @rule(index=st.integers(0, 5))
    def retry(self, index: int) -> None:
        """Retry now: a retrying run skips its backoff; a dead run is requeued."""
        run = self.pick(index)
        before = db_now()
        changed = transitions.retry([self.load(run)], ACTOR)
        after = db_now()
        if run.state == "retrying":
            assert [r.pk for r in changed] == [run.pk]
            run.state = "ready"
            self.now_set(run, before, after)
        elif run.state == "dead":
            assert [r.pk for r in changed] == [run.pk]
            self.requeued(run, before, after)
        else:
            assert changed == [], f"retried a run that was {run.state}"

    def requeued(self, run: RunModel, before: datetime, after: datetime) -> None:
        run.state = "ready"
        run.max_attempts = run.attempt + self.policies[run.definition].max_attempts
        self.now_set(run, before, after)

    @rule(index=st.integers(0, 5))
    def requeue(self, index: int) -> None:
        run = self.pick(index)
        before = db_now()
        changed = transitions.requeue([self.load(run)], ACTOR)
        after = db_now()
        if run.state == "dead":
            assert [r.pk for r in changed] == [run.pk]
            self.requeued(run, before, after)
        else:
            assert changed == [], f"requeued a run that was {run.state}"

    @rule(index=st.integers(0, 5))
    def discard(self, index: int) -> None:
        run = self.pick(index)
        changed = transitions.discard([self.load(run)], ACTOR)
        if run.state == "dead":
            assert [r.pk for r in changed] == [run.pk]
            run.state = "cancelled"
        else:
            assert changed == [], f"discarded a run that was {run.state}"

    # --- the clock ------------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([1, 10, 40, LEASE_SECONDS + 60, TIMEOUT_SECONDS + 60]))
    def advance(self, seconds: int) -> None:
        """Let `seconds` pass: every deadline of every row moves that far into the past."""
        shift = timedelta(seconds=seconds)
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE runs_run SET available_at = available_at - %(shift)s, "
                "lease_expires_at = lease_expires_at - %(shift)s, "
                "timeout_at = timeout_at - %(shift)s",
                {"shift": shift},
            )
            cursor.execute(
                "UPDATE runs_ratestart SET started_at = started_at - %(shift)s", {"shift": shift}
            )
            cursor.execute(
                "UPDATE jobs_jobdefinition SET rate_blocked_until = rate_blocked_until - %(shift)s",
                {"shift": shift},
            )
        self.rated_starts = [(a - shift, b - shift) for a, b in self.rated_starts]
        for run in self.runs:
            run.available_at -= shift
            if run.lease_expires_at is not None:
                run.lease_expires_at -= shift
            if run.timeout_at is not None:
                run.timeout_at -= shift

    # --- checks after every step ----------------------------------------------------------------

    @invariant()
    def database_matches_model(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT id, state, attempt, max_attempts, fencing_token, available_at, "
                "lease_expires_at, timeout_at, cancel_requested FROM runs_run WHERE team_id = %s",
                [self.team.pk],
            )
            rows = {row[0]: row[1:] for row in cursor.fetchall()}
        assert set(rows) == set(self.by_pk), "runs appeared or vanished"
        for run in self.runs:
            assert rows[run.pk] == run.row(), (
                f"run {run.pk} of {run.definition}: database {rows[run.pk]} != model {run.row()}"
            )
            assert run.attempt <= run.max_attempts

    @invariant()
    def one_attempt_per_token(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT a.run_id, a.number, a.fencing_token FROM runs_attempt a "
                "JOIN runs_run r ON r.id = a.run_id WHERE r.team_id = %s "
                "ORDER BY a.run_id, a.number",
                [self.team.pk],
            )
            attempts: dict[int, list[tuple[int, int]]] = {}
            for run_id, number, token in cursor.fetchall():
                attempts.setdefault(run_id, []).append((number, token))
        for run in self.runs:
            expected = list(enumerate(run.tokens, start=1))
            assert attempts.get(run.pk, []) == expected, (run.pk, attempts.get(run.pk), expected)
            assert all(a < b for a, b in pairwise(run.tokens)), run.tokens


@pytest.mark.django_db(transaction=True)
def test_run_state_machine_matches_model() -> None:
    run_state_machine_as_test(RunStateMachine, settings=MODEL_SETTINGS)


@pytest.mark.django_db(transaction=True)
def test_a_definition_at_its_limit_does_not_hold_back_its_lane() -> None:
    """The shortest failure the state machine found, kept as a fixed case.

    Five runs of a definition with concurrency 1 and one run of an unlimited definition share a
    claim lane (team, queue, priority). A claim of 2 leases one limited run; the unlimited run is
    claimable and must be the second ("a definition at its limit is skipped, not waited on").
    """
    team = Team.objects.create(slug="lane", name="Lane")
    limited = make_definition(team, "lane.limited", queue="q", concurrency=1)
    free = make_definition(team, "lane.free", queue="q")
    now = db_now()
    runs = [
        NewRun(d.pk, "api", at, at, f"lane-{i}")
        for i, d in enumerate([limited] * 5 + [free])
        for at in [now - timedelta(seconds=10) + timedelta(microseconds=i)]
    ]
    insert_runs(runs)
    leases = store.claim(
        queues=["q"], max_runs=2, worker_id="w", lease_seconds=60, team_ids=[team.pk]
    )
    assert sorted(lease.job for lease in leases) == ["lane.free", "lane.limited"]
