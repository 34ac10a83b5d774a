"""The Worker in this process against the real API over HTTP (pytest-django's live server)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time
from typing import Any

import httpx
import pytest
from cronlease_client import ApiError, Context, NonRetryable, Worker, load_handlers
from cronlease_client.transport import Transport
from django.conf import settings

from apps.runs import store
from apps.runs.ids import public_run_id
from apps.runs.models import Attempt, Run
from tests.client import handlers_for_pools
from tests.client.conftest import forwarding, read_ledger, runs_when, wait_for
from tests.client.scripted import Request, Response, json_response
from tests.conftest import Api, add_ready_runs, expire_lease, make_definition

pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLES = "examples.plain_worker.handlers"


def test_ready_runs_succeed_and_handlers_see_their_key_and_token(team_a, make_worker, ledger):
    definition = make_definition(
        team_a,
        "billing.record-charge",
        queue="billing",
        payload={"customer": "acme", "amountCents": 1200},
    )
    ids = add_ready_runs(definition, 6)
    make_worker(["billing"], handlers=load_handlers(EXAMPLES), concurrency=3).start()

    runs = wait_for(runs_when(ids, "succeeded"), what="all runs succeeded")

    effects = read_ledger(ledger)
    assert len(effects) == 6
    for run in runs:
        assert run.attempt == 1
        assert run.result == {"charged": True, "customer": "acme", "amountCents": 1200}
        # The handler wrote under the run's own key and the token of its (only) lease.
        effect = effects[run.idempotency_key]
        assert effect["run_id"] == public_run_id(run.pk)
        assert effect["fencing_token"] == run.fencing_token
        assert effect["attempt"] == 1
    assert set(Attempt.objects.filter(run_id__in=ids).values_list("outcome", flat=True)) == {
        "succeeded"
    }


def test_a_raising_handler_fails_the_run_with_its_error_and_it_is_retried(team_a, make_worker):
    definition = make_definition(
        team_a, "etl.broken", queue="etl", retry_max_attempts=2, retry_base_seconds=0
    )
    (pk,) = add_ready_runs(definition, 1)

    def broken(ctx: Context) -> None:
        raise ValueError(f"bad row on attempt {ctx.attempt}")

    make_worker(["etl"], handlers={"etl.broken": broken}).start()

    (run,) = wait_for(runs_when([pk], "dead"), what="the run dead after its two attempts")
    assert run.attempt == 2
    # The stack as the worker sent it (the traceback module ends it with a newline).
    assert run.last_error.pop("stack").endswith("ValueError: bad row on attempt 2\n")
    assert run.last_error == {"type": "ValueError", "message": "bad row on attempt 2"}
    attempts = list(Attempt.objects.filter(run_id=pk).order_by("number"))
    assert [(a.number, a.outcome, a.error_type) for a in attempts] == [
        (1, "failed", "ValueError"),
        (2, "failed", "ValueError"),
    ]
    assert attempts[0].error_message == "bad row on attempt 1"


def test_a_retryable_failure_can_succeed_on_the_next_attempt(team_a, make_worker):
    definition = make_definition(
        team_a, "demo.flaky", queue="flaky", payload={"failAttempts": 1}, retry_base_seconds=0
    )
    (pk,) = add_ready_runs(definition, 1)
    make_worker(["flaky"], handlers=load_handlers(EXAMPLES)).start()

    (run,) = wait_for(runs_when([pk], "succeeded"), what="success on attempt 2")
    assert run.attempt == 2
    assert run.result == {"attempt": 2}
    first = Attempt.objects.get(run_id=pk, number=1)
    assert (first.outcome, first.error_type) == ("failed", "ConnectionError")


def raise_non_retryable(ctx: Context) -> None:
    try:
        int("twelve")
    except ValueError as exc:
        raise NonRetryable("amount is not a number") from exc


def refuse_retries(ctx: Context) -> None:
    ctx.retryable = False
    raise KeyError("customer")


@pytest.mark.parametrize(
    ("handler", "error"),
    [
        (raise_non_retryable, {"type": "ValueError", "message": "amount is not a number"}),
        (refuse_retries, {"type": "KeyError", "message": "'customer'"}),
    ],
)
def test_a_non_retryable_failure_goes_straight_to_dead(team_a, make_worker, handler, error):
    definition = make_definition(
        team_a, "billing.strict", queue="strict", retry_max_attempts=5, retry_base_seconds=0
    )
    (pk,) = add_ready_runs(definition, 1)
    make_worker(["strict"], handlers={"billing.strict": handler}).start()

    (run,) = wait_for(runs_when([pk], "dead"), what="the run dead")
    assert run.attempt == 1
    assert "Traceback (most recent call last)" in run.last_error.pop("stack")
    assert run.last_error == error


def held_heartbeats(worker: Worker) -> threading.Event:
    """Hold the worker's heartbeats back until the event returned is set."""
    heartbeats_on = threading.Event()
    real_heartbeat = worker.heartbeat_once
    worker.heartbeat_once = lambda: real_heartbeat() if heartbeats_on.is_set() else None
    return heartbeats_on


def test_a_lost_lease_is_signalled_and_the_late_result_not_sent(
    live_server, team_a, worker_token_a, make_worker
):
    definition = make_definition(team_a, "demo.hold", queue="lost", retry_base_seconds=0)
    (pk,) = add_ready_runs(definition, 1)
    seen: dict[str, Any] = {}
    returned = threading.Event()

    def hold(ctx: Context) -> dict[str, bool]:
        seen["token"] = ctx.fencing_token
        seen["lost"] = ctx.lease_lost.wait(20)
        returned.set()
        return {"done": True}

    # One slot, held by the handler: the worker cannot re-claim the run itself once it is reaped.
    worker = make_worker(
        ["lost"],
        handlers={"demo.hold": hold},
        concurrency=1,
        lease_seconds=2,
        heartbeat_interval=0.2,
    )
    # Heartbeats are held back (a stalled worker) until another claimer has the run.
    heartbeats_on = held_heartbeats(worker)
    sent: list[str] = []
    real_send = worker._send_results
    worker._send_results = lambda batch: (sent.extend(r.run_id for r, _ in batch), real_send(batch))
    worker.start()

    wait_for(lambda: "token" in seen, what="the handler to start")
    expire_lease(pk)
    assert [reaped.id for reaped in store.reap()] == [pk]
    (other,) = Api(live_server.url, worker_token_a).lease(["lost"], max_runs=1, worker="other")
    assert other["fencingToken"] > seen["token"]

    heartbeats_on.set()
    assert returned.wait(10), "the handler never saw lease_lost"
    assert seen["lost"] is True
    assert worker.stop(timeout=15)

    assert sent == []
    run = Run.objects.get(pk=pk)
    # Still the other claimer's: the first handler's completion changed nothing.
    assert (run.state, run.attempt, run.fencing_token, run.worker_id) == (
        "leased",
        2,
        other["fencingToken"],
        "other",
    )
    outcomes = dict(Attempt.objects.filter(run_id=pk).values_list("number", "outcome"))
    assert outcomes == {1: "lease_expired", 2: ""}


def test_an_expired_lease_not_yet_reaped_stays_the_workers_and_its_result_is_taken(
    team_a, make_worker
):
    """A worker stalled past its lease (a pause, a partition) while the reaper had not run: its
    heartbeat is refused (`/lease-expired`), and it told the handler the lease was lost and
    dropped the result, which the scheduler would still take: the reaper then retried the run,
    and its work was done twice. The handler is not told (one that stopped would return what
    is taken as done) and its result is sent."""
    definition = make_definition(team_a, "demo.stalled", queue="stalled", retry_base_seconds=0)
    (pk,) = add_ready_runs(definition, 1)
    seen: dict[str, Any] = {}
    release = threading.Event()

    def stalled(ctx: Context) -> dict[str, bool]:
        seen["ctx"] = ctx
        release.wait(20)
        return {"done": True}

    worker = make_worker(
        ["stalled"],
        handlers={"demo.stalled": stalled},
        concurrency=1,
        lease_seconds=2,
        heartbeat_interval=0.2,
    )
    heartbeats_on = held_heartbeats(worker)
    worker.start()
    wait_for(lambda: "ctx" in seen, what="the handler to start")
    expire_lease(pk)  # and no reaper runs
    heartbeats_on.set()
    wait_for(
        lambda: any(run.expired for run in list(worker._inflight.values())),
        what="a heartbeat refused as expired",
    )
    assert not seen["ctx"].lease_lost.is_set()
    release.set()
    wait_for(lambda: Run.objects.get(pk=pk).state == "succeeded", what="the result to be taken")
    assert worker.stop(timeout=15)
    run = Run.objects.get(pk=pk)
    assert (run.attempt, run.result) == (1, {"done": True})
    assert list(Attempt.objects.filter(run_id=pk).values_list("outcome", flat=True)) == [
        "succeeded"
    ]


def test_a_result_carried_by_a_lease_request_is_answered_at_once_not_after_its_long_poll(
    team_a, make_worker
):
    """A result rode the next lease request, which long-polled (20 s) before answering: its
    run was heartbeated meanwhile (each refused: not leased, a stale token in the metrics),
    and a stop during the poll sent the result again (refused: already recorded)."""
    definition = make_definition(team_a, "demo.quick", queue="quick")
    (pk,) = add_ready_runs(definition, 1)
    worker = make_worker(
        ["quick"],
        handlers={"demo.quick": lambda ctx: {"ok": True}},
        concurrency=1,
        lease_seconds=3,
        heartbeat_interval=0.2,
        wait_seconds=2,
    )
    refused: list[str] = []
    real_extend = worker._extend

    def extend(leases):
        answer = real_extend(leases)
        refused.extend(answer)
        return answer

    worker._extend = extend
    sent_apart: list[str] = []
    real_send = worker._send_results
    worker._send_results = lambda batch: (
        sent_apart.extend(r.run_id for r, _ in batch),
        real_send(batch),
    )[1]
    worker.start()
    wait_for(lambda: Run.objects.get(pk=pk).state == "succeeded", what="the run done")
    time.sleep(1.0)  # five heartbeat rounds, within the long poll that follows
    assert worker.stop(timeout=15)
    time.sleep(1.5)  # the server ends its side of that poll
    assert refused == [] and sent_apart == []
    assert not worker._inflight


def test_a_run_leased_again_to_the_same_worker_keeps_its_new_lease(team_a, make_worker):
    """The older attempt's handler runs on past its lease and this worker, with a free slot,
    leases the retry. The newer attempt is heartbeated and its result taken; the older is told
    its lease is gone and its outcome dropped. Keyed by run, the older's end stopped the newer's
    heartbeats: a web outage ran a healthy run up to its maxAttempts and left it dead."""
    definition = make_definition(team_a, "demo.twice", queue="again", retry_base_seconds=0)
    (pk,) = add_ready_runs(definition, 1)
    seen: dict[int, Any] = {}
    first_returned = threading.Event()

    def twice(ctx: Context) -> dict[str, int]:
        seen[ctx.attempt] = None
        if ctx.attempt == 1:
            seen[1] = ctx.lease_lost.wait(5)
            first_returned.set()
        else:
            first_returned.wait(10)
            time.sleep(3)  # past its 2 s lease: it lives on heartbeats alone
        return {"attempt": ctx.attempt}

    worker = make_worker(
        ["again"],
        handlers={"demo.twice": twice},
        concurrency=2,
        lease_seconds=2,
        heartbeat_interval=0.2,
    )
    # Heartbeats are held back (a web outage) until the run has been leased again.
    heartbeats_on = held_heartbeats(worker)
    worker.start()

    wait_for(lambda: 1 in seen, what="the first attempt to start")
    expire_lease(pk)
    assert [reaped.id for reaped in store.reap()] == [pk]
    wait_for(lambda: 2 in seen, what="the worker to lease the run again")
    heartbeats_on.set()

    run = wait_for(lambda: (r := Run.objects.get(pk=pk)).state == "succeeded" and r, timeout=20)
    assert seen[1] is True, "the older attempt was never told its lease was gone"
    assert run.result == {"attempt": 2}
    outcomes = dict(Attempt.objects.filter(run_id=pk).values_list("number", "outcome"))
    assert outcomes == {1: "lease_expired", 2: "succeeded"}
    assert worker.stop(timeout=15)


def test_dry_runs_skip_handlers_that_did_not_opt_in(team_a, make_worker, ledger):
    sleeper = make_definition(team_a, "demo.sleep", queue="dry", dry_run=True)
    charge = make_definition(
        team_a,
        "billing.record-charge",
        queue="dry",
        dry_run=True,
        payload={"customer": "acme", "amountCents": 5},
    )
    skipped = add_ready_runs(sleeper, 2)
    opted_in = add_ready_runs(charge, 1)
    called: list[str] = []
    handlers = load_handlers(EXAMPLES)
    handlers["demo.sleep"] = lambda ctx: called.append(ctx.run_id)
    make_worker(["dry"], handlers=handlers).start()

    runs = wait_for(runs_when(skipped + opted_in, "succeeded"), what="dry runs done")
    assert called == []
    assert [run.result for run in runs[:2]] == [{"dryRun": True, "skipped": True}] * 2
    assert runs[2].result == {"wouldCharge": {"customer": "acme", "amountCents": 5}}
    assert read_ledger(ledger) == {}


def test_the_worker_leases_only_runs_of_jobs_it_has_a_handler_for(team_a, make_worker):
    unknown = make_definition(team_a, "reports.unknown", queue="mixed", retry_max_attempts=2)
    known = make_definition(team_a, "reports.known", queue="mixed")
    # The unknown job's runs are older: leased first, were they leased at all.
    others = add_ready_runs(unknown, 3, prefix="u")
    ours = add_ready_runs(known, 3, prefix="k")
    worker = make_worker(["mixed"], handlers={"reports.known": lambda ctx: {"ok": True}})
    asked: list[dict[str, Any]] = []
    real_post = Transport.post

    def spy(self: Transport, path: str, body: dict[str, Any], **kwargs: Any) -> Any:
        if path == "/api/v1/leases":
            asked.append(body)
        return real_post(self, path, body, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Transport, "post", spy)
        worker.start()
        wait_for(runs_when(ours, "succeeded"), what="the known job's runs succeeded")
        wait_for(lambda: len(asked) >= 3, what="more lease requests after them")

    assert all(body["jobs"] == ["reports.known"] for body in asked)
    # Never leased: no attempt used (they are claimable, "scheduled" with a past due time).
    untouched = Run.objects.filter(pk__in=others).values_list("state", "attempt")
    assert sorted(untouched) == [("scheduled", 0)] * 3


def test_a_handler_name_that_cannot_be_a_job_is_refused_at_registration():
    with pytest.raises(ValueError, match="cannot be a job's name"):
        Worker("http://127.0.0.1:9", "t", ["q"], handlers={"Reports Known": lambda ctx: None})


def test_with_more_handlers_than_a_lease_request_can_name_every_job_is_leased():
    handlers = {f"jobs.n{index}": (lambda ctx: None) for index in range(1001)}
    worker = Worker("http://127.0.0.1:9", "t", ["q"], handlers=handlers)
    assert worker._jobs is None
    del handlers["jobs.n1000"]
    assert Worker("http://127.0.0.1:9", "t", ["q"], handlers=handlers)._jobs == sorted(handlers)


async def async_double(ctx: Context) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"double": ctx.payload["n"] * 2, "attempt": ctx.attempt}


async def async_broken(ctx: Context) -> None:
    await asyncio.sleep(0)
    raise NonRetryable("no upstream for this order")


def test_an_async_handler_is_awaited_and_its_result_reported(team_a, make_worker):
    definition = make_definition(team_a, "demo.async", queue="async", payload={"n": 21})
    ids = add_ready_runs(definition, 2)
    make_worker(["async"], handlers={"demo.async": async_double}).start()

    runs = wait_for(runs_when(ids, "succeeded"), what="the async handler's runs succeeded")
    assert [run.result for run in runs] == [{"double": 42, "attempt": 1}] * 2


def test_an_async_handlers_exception_fails_the_run(team_a, make_worker):
    definition = make_definition(team_a, "demo.async-broken", queue="async", retry_max_attempts=3)
    (pk,) = add_ready_runs(definition, 1)
    make_worker(["async"], handlers={"demo.async-broken": async_broken}).start()

    (run,) = wait_for(runs_when([pk], "dead"), what="the run dead")
    assert run.attempt == 1
    assert "NonRetryable: no upstream for this order" in run.last_error.pop("stack")
    assert run.last_error == {"type": "NonRetryable", "message": "no upstream for this order"}


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("concurrency", [1, 4], ids=["carried", "apart"])
def test_a_result_the_scheduler_refuses_fails_the_run_for_good(team_a, make_worker, concurrency):
    """A result nested past the scheduler's depth limit: the run is failed (not retried, which
    would run the handler again to the same end) with the reason, not left to its lease."""
    definition = make_definition(team_a, "demo.deep", queue="deep", retry_max_attempts=3)
    (pk,) = add_ready_runs(definition, 1)
    calls: list[int] = []

    def deep(ctx: Context) -> list[Any]:
        calls.append(ctx.attempt)
        return nested(settings.SCHEDULER_JSON_MAX_DEPTH + 5)

    make_worker(["deep"], handlers={"demo.deep": deep}, concurrency=concurrency).start()

    (run,) = wait_for(runs_when([pk], "dead"), timeout=10, what="the run failed for good")
    assert calls == [1]
    assert run.attempt == 1
    assert run.last_error["type"] == "ResultRefused"
    assert "Nested deeper than" in run.last_error["message"]
    (attempt,) = Attempt.objects.filter(run_id=pk)
    assert (attempt.outcome, attempt.error_type) == ("failed", "ResultRefused")


def test_process_pool_runs_handlers_and_reports_their_errors(team_a, make_worker, ledger):
    charge = make_definition(
        team_a,
        "billing.record-charge",
        queue="proc",
        payload={"customer": "acme", "amountCents": 7},
    )
    flaky = make_definition(
        team_a,
        "demo.flaky",
        queue="proc",
        payload={"failAttempts": 5},
        retry_max_attempts=1,
    )
    charges = add_ready_runs(charge, 3)
    (failing,) = add_ready_runs(flaky, 1, prefix="f")
    make_worker(["proc"], handlers=load_handlers(EXAMPLES), pool="process", concurrency=2).start()

    runs = wait_for(runs_when(charges, "succeeded"), timeout=60, what="charges done")
    (dead,) = wait_for(runs_when([failing], "dead"), timeout=30, what="flaky run dead")
    assert "ConnectionError: upstream unavailable" in dead.last_error.pop("stack")
    assert dead.last_error == {
        "type": "ConnectionError",
        "message": "upstream unavailable on attempt 1",
    }
    effects = read_ledger(ledger)
    assert {run.idempotency_key: run.fencing_token for run in runs} == {
        key: effect["fencing_token"] for key, effect in effects.items()
    }


def test_results_and_heartbeats_travel_in_batches(team_a, make_worker, monkeypatch):
    definition = make_definition(team_a, "demo.together", queue="batch")
    ids = add_ready_runs(definition, 8)
    calls: list[tuple[str, int]] = []
    real_post = Transport.post

    def spy(self: Transport, path: str, body: dict[str, Any], **kwargs: Any) -> Any:
        items = body.get("results") or (body.get("leases") if "heartbeats" in path else None)
        if items is not None:
            calls.append((path, len(items)))
        return real_post(self, path, body, **kwargs)

    monkeypatch.setattr(Transport, "post", spy)
    barrier = threading.Barrier(8, timeout=20)

    def together(ctx: Context) -> None:
        barrier.wait()
        time.sleep(0.8)  # long enough for heartbeat rounds with all eight leases

    make_worker(
        ["batch"], handlers={"demo.together": together}, concurrency=8, heartbeat_interval=0.2
    ).start()

    wait_for(runs_when(ids, "succeeded"), what="all eight runs succeeded")
    # Sent apart or carried by the next lease request.
    results = [size for path, size in calls if path in ("/api/v1/results", "/api/v1/leases")]
    heartbeats = [size for path, size in calls if path == "/api/v1/heartbeats"]
    assert sum(results) == 8
    assert len(results) < 8, results
    assert 8 in heartbeats, heartbeats


def test_with_a_backlog_the_lease_requests_carry_the_results(team_a, make_worker, monkeypatch):
    """One request per batch instead of two: the outcomes that finished while the worker waited
    for slots ride on its next lease request, and each is answered there."""
    definition = make_definition(team_a, "demo.carried", queue="carried")
    ids = add_ready_runs(definition, 200)
    sent: dict[str, int] = {"/api/v1/results": 0, "/api/v1/leases": 0}
    answered: list[int] = []
    real_post = Transport.post

    def spy(self: Transport, path: str, body: dict[str, Any], **kwargs: Any) -> Any:
        answer = real_post(self, path, body, **kwargs)
        if path in sent and body.get("results"):
            sent[path] += len(body["results"])
            # The lease answer comes back parsed: (leases, results); the results' as its items.
            items = answer[1] if path == "/api/v1/leases" else answer
            answered.extend(item["status"] for item in items)
        return answer

    monkeypatch.setattr(Transport, "post", spy)
    make_worker(["carried"], handlers={"demo.carried": lambda ctx: None}, concurrency=4).start()
    wait_for(runs_when(ids, "succeeded"), what="all 200 runs succeeded")
    wait_for(lambda: sum(sent.values()) == 200, what="every outcome answered")
    assert answered == [200] * 200
    assert sent["/api/v1/leases"] > sent["/api/v1/results"], sent


def test_after_a_full_answer_the_next_lease_call_waits_to_fill_a_batch(
    team_a, make_worker, monkeypatch
):
    """With a backlog, a lease call per freed slot would send batches of one; after a full answer
    the worker waits (briefly) for half its slots before it asks again."""
    definition = make_definition(team_a, "demo.backlog", queue="backlog")
    ids = add_ready_runs(definition, 60)
    asked: list[int] = []
    real_post = Transport.post

    def spy(self: Transport, path: str, body: dict[str, Any], **kwargs: Any) -> Any:
        answer = real_post(self, path, body, **kwargs)
        if path == "/api/v1/leases" and answer[0]:  # parsed: (leases, results)
            asked.append(body["max"])
        return answer

    monkeypatch.setattr(Transport, "post", spy)
    # Handlers that end one after another, a few milliseconds apart, as real ones do.
    make_worker(
        ["backlog"],
        handlers={
            "demo.backlog": lambda ctx: time.sleep(0.002 * (ctx.attempt + len(ctx.run_id) % 7))
        },
        concurrency=10,
    ).start()

    wait_for(runs_when(ids, "succeeded"), what="the backlog drained")
    assert asked[0] == 10
    # Every call that leased something asked for at least half a batch.
    assert min(asked) >= 5, asked


def test_a_refused_token_stops_run_with_the_error(live_server):
    worker = Worker(live_server.url, "jst_not-a-token", ["any"], handlers={"x": lambda ctx: None})
    started = time.monotonic()
    with pytest.raises(ApiError) as caught:
        worker.run()
    assert caught.value.status == 401
    assert time.monotonic() - started < 10


def test_leases_wait_for_results_when_reporting_is_slower_than_leasing(
    team_a, make_worker, monkeypatch
):
    """Handlers that return at once and a scheduler slow to take results: the worker must not
    keep leasing into an ever larger pile of unreported runs (memory, heartbeats, and runs that
    sit leased instead of done). At most `concurrency` results wait unreported."""
    definition = make_definition(team_a, "demo.fast", queue="slowresults")
    ids = add_ready_runs(definition, 60)
    real_post = Transport.post

    def slow_results(self: Transport, path: str, body: dict[str, Any], **kwargs: Any) -> Any:
        if path == "/api/v1/results":
            time.sleep(0.3)
        return real_post(self, path, body, **kwargs)

    monkeypatch.setattr(Transport, "post", slow_results)
    held: list[int] = []
    done = threading.Event()

    def sample() -> None:
        # Its own connection: leased runs of the queue, every 20 ms.
        from django.db import connection

        try:
            while not done.is_set():
                held.append(Run.objects.filter(pk__in=ids, state="leased").count())
                time.sleep(0.02)
        finally:
            connection.close()

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        make_worker(
            ["slowresults"], handlers={"demo.fast": lambda ctx: None}, concurrency=5
        ).start()
        wait_for(runs_when(ids, "succeeded"), what="all runs succeeded", timeout=60)
    finally:
        done.set()
        sampler.join()
    assert held and max(held) <= 10, max(held)


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_cancelling_a_running_run_stops_its_handler_and_ends_it_cancelled(
    live_server, team_a, token_a, make_worker, pool
):
    definition = make_definition(
        team_a,
        "demo.steps",
        queue="steps",
        retry_max_attempts=5,
        payload={"steps": 400, "stepSeconds": 0.05},
    )
    (pk,) = add_ready_runs(definition, 1)
    worker = make_worker(
        ["steps"],
        handlers=load_handlers(EXAMPLES),
        concurrency=1,
        pool=pool,
        lease_seconds=3,
        heartbeat_interval=0.2,
    )
    worker.start()
    wait_for(lambda: Run.objects.get(pk=pk).state == "leased", what="the run to be leased")

    answer = Api(live_server.url, token_a).post(f"/api/v1/runs/{public_run_id(pk)}/cancel")
    assert answer.status_code == 202, answer.text

    wait_for(lambda: Run.objects.get(pk=pk).state == "cancelled", what="the run to end cancelled")
    run = Run.objects.get(pk=pk)
    assert run.attempt == 1  # not retried, attempts left or not
    (attempt,) = Attempt.objects.filter(run_id=pk)
    assert attempt.outcome == "cancelled" and attempt.ended_at is not None
    assert run.last_error["type"] == "RunCancelled"
    assert worker.stop(timeout=15)


def test_a_handler_deaf_to_a_cancel_runs_past_its_lease_and_is_reported(
    live_server, team_a, token_a, make_worker
):
    """The worker stopped heartbeating a run once told it was cancelled, and the server no
    longer extended it: a handler that ran on past the lease's end had its result refused,
    and the run's error said its lease expired "without a heartbeat"."""
    definition = make_definition(team_a, "demo.deaf", queue="deaf", retry_max_attempts=5)
    (pk,) = add_ready_runs(definition, 1)
    started = threading.Event()

    def deaf(ctx) -> dict:
        started.set()
        time.sleep(7)  # past two leases of 3 s after the cancel, checking nothing
        return {"finished": True}

    worker = make_worker(
        ["deaf"], handlers={"demo.deaf": deaf}, concurrency=1, lease_seconds=3,
        heartbeat_interval=0.5,
    )  # fmt: skip
    worker.start()
    assert started.wait(30)
    answer = Api(live_server.url, token_a).post(f"/api/v1/runs/{public_run_id(pk)}/cancel")
    assert answer.status_code == 202, answer.text

    def ended() -> bool:
        store.reap()  # as the scheduler does: a lease left to run out is taken
        return Run.objects.get(pk=pk).state == "cancelled"

    wait_for(ended, what="the run to end", timeout=30)
    run = Run.objects.get(pk=pk)
    (attempt,) = Attempt.objects.filter(run_id=pk)
    assert (attempt.outcome, run.result) == ("cancelled", {"finished": True}), run.last_error
    assert worker.stop(timeout=15)


def test_a_handlers_flag_is_an_event_whose_set_is_never_missed_by_a_waiter():
    """The flags behind ctx.lease_lost and ctx.cancelled make their Event only when a handler
    waits; a set racing that wait must still wake it."""
    from cronlease_client.worker import _LocalFlag

    flag = _LocalFlag()
    assert not flag.is_set()
    assert flag.wait(0.01) is False
    flag.set()
    assert flag.is_set() and flag.wait(0) is True

    for _ in range(300):
        flag = _LocalFlag()
        results: list[bool] = []
        waiters = [
            threading.Thread(target=lambda f=flag, r=results: r.append(f.wait(10)))
            for _ in range(3)
        ]
        for waiter in waiters:
            waiter.start()
        flag.set()  # before, during or after the waiters make the Event
        for waiter in waiters:
            waiter.join(15)
        assert results == [True, True, True]


GARBLED = {
    "html": b"<html><body>502 Bad Gateway</body></html>",
    "truncated": b'{"leases": [{"runId": "run_1", "jo',
    "null": b"null",
    "leases not a list": b'{"leases": "nope"}',
    "lease without its fields": b'{"leases": [{"bogus": 1}]}',
}


def relayed(url: str, request: Request, **options: Any) -> Response:
    """`request` sent on to the server at `url`; its answer, with `options` (Response's)."""
    headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}
    answer = httpx.request(
        request.method, url + request.path, content=request.content, headers=headers, timeout=30
    )
    return Response(
        answer.status_code, answer.content, {"Content-Type": "application/json"}, **options
    )


@pytest.mark.parametrize("garbled", GARBLED.values(), ids=GARBLED.keys())
def test_a_garbled_lease_answer_is_retried_and_the_worker_keeps_running(
    live_server, team_a, make_worker, serve, monkeypatch, caplog, garbled
):
    """A 200 to POST /api/v1/leases whose body is not a lease answer (a proxy's page, a cut
    answer, another shape) is a failure that may pass, as a 5xx is: warned about and retried
    with backoff. Only a refused token stops the worker."""
    from cronlease_client import lifecycle, transport

    monkeypatch.setattr(transport, "backoff_delay", lambda failures, **cap: 0.01)
    monkeypatch.setattr(lifecycle, "backoff_delay", lambda failures, **cap: 0.01)
    definition = make_definition(team_a, "demo.after-garble", queue="garbled")
    (pk,) = add_ready_runs(definition, 1)
    garbling = [6]  # the transport's 5 attempts, then one more after the lease loop's backoff

    def relay(request: Request) -> Response:
        if request.path == "/api/v1/leases" and garbling[0] > 0:
            garbling[0] -= 1
            return Response(200, garbled, {"Content-Type": "application/json"})
        return relayed(live_server.url, request)

    proxy = serve(relay)
    worker = make_worker(["garbled"], handlers={"demo.after-garble": lambda ctx: {"ok": True}})
    worker.base_url = proxy.url
    worker.start()

    wait_for(
        lambda: worker.shutdown.is_set() or runs_when([pk], "succeeded")(),
        what="the run to succeed (or the worker to stop)",
    )
    assert not worker.shutdown.is_set() and worker.error is None
    assert Run.objects.get(pk=pk).result == {"ok": True}
    assert garbling == [0]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(message.startswith("leasing failed; retrying") for message in warned), warned


def test_a_lease_damaged_past_the_shape_check_is_failed_as_unreadable_not_run(
    live_server, team_a, make_worker, serve
):
    """A lease whose time a middlebox damaged (its shape intact): the handler is not run, and
    the attempt fails as UnreadableLease, retried; it read as the handler's ValueError."""
    definition = make_definition(team_a, "demo.damaged", queue="damaged", retry_base_seconds=0)
    (pk,) = add_ready_runs(definition, 1)
    damaged = [1]
    ran: list[int] = []

    def relay(request: Request) -> Response:
        answer = relayed(live_server.url, request)
        if (
            request.path == "/api/v1/leases"
            and b'"leaseExpiresAt"' in answer.content
            and damaged[0]
        ):
            damaged[0] -= 1
            content = answer.content.replace(b'"leaseExpiresAt":"2', b'"leaseExpiresAt":"x')
            return dataclasses.replace(answer, content=content)
        return answer

    proxy = serve(relay)
    worker = make_worker(
        ["damaged"], handlers={"demo.damaged": lambda ctx: ran.append(ctx.attempt)}
    )
    worker.base_url = proxy.url
    worker.start()
    wait_for(runs_when([pk], "succeeded"), what="the retry to succeed")
    assert ran == [2]
    first = Attempt.objects.get(run_id=pk, number=1)
    assert (first.outcome, first.error_type) == ("failed", "UnreadableLease")
    assert "did not run the handler" in first.error_message


def lease_requests(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each lease request of `worker` was sent (monotonic), as the spy saw them."""
    sent: list[float] = []
    real_post = Transport.post

    def spy(self: Transport, path: str, body: dict[str, Any], **kwargs: Any) -> Any:
        if path == "/api/v1/leases" and body["workerId"] == worker.worker_id:
            sent.append(time.monotonic())
        return real_post(self, path, body, **kwargs)

    monkeypatch.setattr(Transport, "post", spy)
    return sent


def test_stopping_abandons_the_waiting_long_poll_at_once(
    asgi_server, team_a, token_a, make_worker, monkeypatch
):
    """The long poll (20 s here) is hung up on, not waited out: the worker is gone at once, and
    the scheduler (uvicorn, which sees the hang-up) rolls back whatever it would have claimed.
    uvicorn closes the connection when the worker hangs up: the worker's cut-off, after
    HANGUP_SECONDS (2 s), is not needed."""
    make_definition(team_a, "demo.idle", queue="idle")
    worker = make_worker(
        ["idle"], handlers={"demo.idle": lambda ctx: None}, wait_seconds=20, worker_id="idle-1"
    )
    worker.base_url = asgi_server.url
    sent = lease_requests(worker, monkeypatch)
    worker.start()
    api = Api(asgi_server.url, token_a)
    wait_for(
        lambda: "idle-1" in [w["workerId"] for w in api.get("/api/v1/workers").json()["results"]],
        what="the worker's long poll to reach the scheduler",
    )

    started = time.monotonic()
    assert worker.stop(timeout=10)
    assert time.monotonic() - started < 1.5
    assert len(sent) == 1  # no lease request after the stop


def test_runs_that_arrive_after_the_stop_are_given_back_not_started(
    team_a, make_worker, monkeypatch
):
    definition = make_definition(team_a, "demo.late", queue="late", retry_base_seconds=60)
    ids = add_ready_runs(definition, 2)
    called: list[str] = []
    worker = make_worker(
        ["late"], handlers={"demo.late": lambda ctx: called.append(ctx.run_id)}, grace_seconds=5
    )
    real_post = Transport.post

    def signal_in_flight(self: Transport, path: str, body: dict[str, Any], **kwargs: Any) -> Any:
        answer = real_post(self, path, body, **kwargs)
        if path == "/api/v1/leases":
            # SIGTERM while the answer was on its way back.
            worker._on_signal(signal.SIGTERM, None)
        return answer

    monkeypatch.setattr(Transport, "post", signal_in_flight)
    worker.start()
    assert worker.join(10)

    runs = wait_for(runs_when(ids, "retrying"), what="the runs given back")
    assert called == []
    assert {(run.attempt, run.last_error["type"]) for run in runs} == {(1, "WorkerShutdown")}


def test_a_stop_while_a_batch_is_handed_out_starts_none_of_the_rest(
    team_a, make_worker, monkeypatch
):
    """A stop that lands while the runs of one answer are handed to the slots: the rest are
    given back, not started (a process pool's slots started them up to a second after the
    stop, and a long one was then cut off by the grace period)."""
    definition = make_definition(team_a, "demo.batch", queue="batch", retry_base_seconds=60)
    ids = add_ready_runs(definition, 3)
    called: list[str] = []
    worker = make_worker(
        ["batch"],
        handlers={"demo.batch": lambda ctx: called.append(ctx.run_id)},
        concurrency=3,
        batch_size=3,
    )
    real_dispatch = Worker._dispatch

    def dispatch_then_stop(self: Worker, lease: Any) -> bool:
        handed = real_dispatch(self, lease)
        self._on_signal(signal.SIGTERM, None)  # SIGTERM after the first run is handed out
        return handed

    monkeypatch.setattr(Worker, "_dispatch", dispatch_then_stop)
    worker.start()
    assert worker.join(10)

    runs = wait_for(runs_when(ids, "retrying", "succeeded"), what="every run settled")
    given_back = [run for run in runs if run.state == "retrying"]
    assert len(called) <= 1 and len(given_back) == 3 - len(called)
    assert {(run.attempt, run.last_error["type"]) for run in given_back} == {(1, "WorkerShutdown")}


def test_runs_whose_answer_was_still_arriving_at_the_stop_are_given_back(
    live_server, team_a, make_worker, serve
):
    """The stop lands between the lease answer's headers and its body. The body is still read
    and its runs given back at once, not lost with the answer and left leased until their lease
    expires."""
    definition = make_definition(team_a, "demo.split", queue="split", retry_base_seconds=60)
    ids = add_ready_runs(definition, 2)
    called: list[str] = []

    def relay(request: Request) -> Response:
        split = request.path == "/api/v1/leases"
        return relayed(live_server.url, request, body_after_hangup=split)

    proxy = serve(relay)
    worker = make_worker(["split"], handlers={"demo.split": lambda ctx: called.append(ctx.run_id)})
    worker.base_url = proxy.url
    worker.start()
    assert proxy.headers_sent.wait(10)
    assert worker.stop(timeout=10)

    runs = wait_for(runs_when(ids, "retrying"), what="the runs given back")
    assert called == []
    assert {(run.attempt, run.last_error["type"]) for run in runs} == {(1, "WorkerShutdown")}
    assert proxy.before_hangup == [b""]


def test_a_dead_handler_process_fails_its_run_and_a_new_pool_takes_the_next(team_a, make_worker):
    crash = make_definition(team_a, "demo.crash", queue="pool", retry_max_attempts=1)
    fine = make_definition(team_a, "demo.fine", queue="pool")
    (crashed,) = add_ready_runs(crash, 1, prefix="c")
    handlers = {"demo.crash": handlers_for_pools.die, "demo.fine": handlers_for_pools.succeed}
    make_worker(["pool"], handlers=handlers, pool="process", concurrency=2).start()

    (dead,) = wait_for(runs_when([crashed], "dead"), timeout=60, what="the crashed run failed")
    assert dead.last_error["type"] == "HandlerProcessDied"
    # The pool that lost a process is replaced: the runs after it succeed, not fail at once.
    later = add_ready_runs(fine, 3, prefix="f")
    runs = wait_for(runs_when(later, "succeeded"), timeout=60, what="the later runs done")
    assert [run.attempt for run in runs] == [1, 1, 1]


def test_text_the_scheduler_cannot_store_is_escaped_not_lost(team_a, make_worker):
    """A lone surrogate (a file name read with surrogateescape) or a NUL in an error, and a
    result that is not JSON as the scheduler reads it: each run ends with its outcome, beside
    a plain success in the same batch, and the worker keeps running."""
    definition = make_definition(team_a, "demo.text", queue="text", retry_max_attempts=1)
    handlers_by_key: dict[str, Any] = {
        "surrogate-error": ValueError("file-\udcff"),
        "nul-error": ValueError("bad\x00byte"),
        "surrogate-result": {"name": "file-\udcff"},
        "nan-result": {"v": float("nan")},
        "plain": {"ok": True},
    }

    def handle(ctx: Context) -> Any:
        outcome = handlers_by_key[ctx.idempotency_key]
        if isinstance(outcome, Exception):
            raise NonRetryable(str(outcome))
        return outcome

    store.insert_runs(
        [
            store.NewRun(definition.pk, "api", definition.created_at, definition.created_at, key)
            for key in handlers_by_key
        ]
    )
    worker = make_worker(["text"], handlers={"demo.text": handle}, concurrency=5)
    worker.start()
    pks = list(Run.objects.values_list("pk", flat=True))
    runs = wait_for(runs_when(pks, "dead", "succeeded"), timeout=30, what="every run ended")
    by_key = {run.idempotency_key: run for run in runs}
    assert by_key["surrogate-error"].last_error["message"] == "file-\\udcff"
    assert by_key["nul-error"].last_error["message"] == "bad\\x00byte"
    assert by_key["surrogate-result"].state == "succeeded"
    assert "unserializable" in by_key["surrogate-result"].result
    assert by_key["nan-result"].result == {"unserializable": "{'v': nan}"}
    assert by_key["plain"].result == {"ok": True}
    assert not worker.shutdown.is_set()


def test_a_result_is_held_through_a_web_restart_longer_than_the_transports_tries(
    team_a, live_server, worker_token_a, serve, monkeypatch
):
    """The scheduler unreachable for longer than the transport retries a request (three tries
    here, about a second; ten, about 20 s, by default) while the lease runs for 30: the result
    is sent once the scheduler is back, and the run is not leased and run a second time."""
    made = Worker._transport
    monkeypatch.setattr(
        Worker,
        "_transport",
        lambda self, *, cancel, attempts=5: made(self, cancel=cancel, attempts=3),
    )
    definition = make_definition(team_a, "demo.restart", queue="restart")
    (pk,) = add_ready_runs(definition, 1)
    down, finished = threading.Event(), threading.Event()
    web = forwarding(live_server.url, down)

    def handle(ctx: Context) -> dict:
        down.set()  # the web process goes away while the handler works
        finished.set()
        return {"done": ctx.attempt}

    worker = Worker(
        serve(web).url, worker_token_a, ["restart"], handlers={"demo.restart": handle},
        lease_seconds=30, wait_seconds=1, grace_seconds=5,
    )  # fmt: skip
    worker.start()
    try:
        assert finished.wait(20)
        time.sleep(4)  # past the transport's tries of the result
        assert Run.objects.get(pk=pk).state == "leased"
        down.clear()
        (run,) = wait_for(runs_when([pk], "succeeded"), timeout=20, what="the result sent")
        assert (run.attempt, run.result) == (1, {"done": 1})
    finally:
        worker.stop(timeout=15)


def test_the_lease_loop_waits_what_retry_after_asks_between_its_rounds(serve, monkeypatch):
    """Throttled (429, Retry-After: 1) on every lease request: no request comes sooner than
    asked, within the transport's tries (two here) or between the lease loop's rounds."""
    made = Worker._transport
    monkeypatch.setattr(
        Worker,
        "_transport",
        lambda self, *, cancel, attempts=5: made(self, cancel=cancel, attempts=2),
    )
    throttled = serve(
        lambda request: json_response(
            429, {"status": 429, "detail": "slow down"}, **{"Retry-After": "1"}
        )
    )
    worker = Worker(throttled.url, "jst_token", ["q"], handlers={"demo.x": lambda ctx: None})
    worker.start()
    try:
        time.sleep(3.6)  # two rounds of two tries
    finally:
        worker.stop(timeout=10)
    times = [request.at for request in throttled.seen if request.path == "/api/v1/leases"]
    assert len(times) >= 4
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    assert min(gaps) >= 0.95, gaps
