"""The producer client (`cronlease_client.Client`, `AsyncClient`) against the live server, and its
retry rules against a scripted transport."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import time_machine
from cronlease_client import (
    ApiError,
    AsyncClient,
    BadRequest,
    ChangedMeanwhile,
    Client,
    Conflict,
    Enqueue,
    FireTime,
    Forbidden,
    IdempotencyConflict,
    Job,
    NetworkError,
    NotFound,
    PayloadTooLarge,
    RateLimit,
    RateLimited,
    Run,
    Unauthorized,
    Unavailable,
)
from cronlease_client.errors import BadAnswer
from django.db import transaction

from apps.runs.ids import public_run_id
from apps.runs.models import Run as RunRow
from apps.teams.models import ApiToken, Team
from tests.client.conftest import CountingTransport
from tests.conftest import Api, add_ready_runs, make_definition


def run_coroutine(coroutine):
    """asyncio.run on a thread of its own: a browser test earlier in the session leaves an event
    loop running on the main thread (Playwright's sync API), where asyncio.run refuses."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


pytestmark = pytest.mark.django_db(transaction=True)

DEFINITION = {"name": "shop.send-receipt", "schedule": {}, "queue": "shop"}


def manage_token(team: Team) -> str:
    return ApiToken.issue(team, ["manage"])[1]


def lease_and_fail(api: Api, queue: str, count: int, *, retryable: bool) -> list[str]:
    """Lease `count` runs of `queue` and fail each; return their ids."""
    leases = api.lease([queue], max_runs=count)
    assert len(leases) == count
    for lease in leases:
        answer = api.post(
            f"/api/v1/runs/{lease['runId']}/fail",
            {
                "fencingToken": lease["fencingToken"],
                "error": {"message": "upstream down", "type": "IOError"},
                "retryable": retryable,
            },
        )
        assert answer.status_code == 200, answer.text
    return [lease["runId"] for lease in leases]


# --- enqueue ---------------------------------------------------------------------------------


def test_enqueue_creates_a_delayed_run_and_the_same_key_answers_it_again(producer, team_a, wire):
    make_definition(team_a, "shop.send-receipt", queue="shop")

    run = producer.enqueue(
        "shop.send-receipt",
        payload={"order": 991},
        delay=timedelta(minutes=5),
        idempotency_key="order-991",
        concurrency_key="customer-7",
    )

    assert isinstance(run, Run)
    assert run.job == "shop.send-receipt"
    assert run.queue == "shop"
    assert run.state == "scheduled"
    assert run.idempotency_key == "order-991"
    assert run.concurrency_key == "customer-7"
    assert run.payload == {"order": 991}
    assert run.trigger == "api"
    assert run.raw["runId"] == run.run_id
    assert timedelta(seconds=299) <= run.available_at - run.created_at <= timedelta(seconds=301)
    assert wire.seen == [("POST", "/api/v1/runs", 200)]

    again = producer.enqueue(
        "shop.send-receipt", payload={"order": 991}, idempotency_key="order-991"
    )
    assert again.run_id == run.run_id
    assert RunRow.objects.count() == 1


def test_enqueue_with_the_key_of_another_payload_is_an_idempotency_conflict(producer, team_a):
    make_definition(team_a, "shop.send-receipt", queue="shop")
    producer.enqueue("shop.send-receipt", payload={"order": 1}, idempotency_key="order-1")

    with pytest.raises(IdempotencyConflict) as caught:
        producer.enqueue("shop.send-receipt", payload={"order": 2}, idempotency_key="order-1")

    assert isinstance(caught.value, Conflict)
    assert caught.value.status == 409
    assert caught.value.type.endswith("/idempotency-conflict")


def test_enqueue_at_a_time_takes_an_aware_datetime_or_an_iso_string(producer, team_a):
    make_definition(team_a, "shop.send-receipt", queue="shop")
    at = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=2)

    by_datetime = producer.enqueue("shop.send-receipt", run_at=at, idempotency_key="a")
    by_string = producer.enqueue(
        "shop.send-receipt", run_at=at.isoformat().replace("+00:00", "Z"), idempotency_key="b"
    )

    assert by_datetime.due_at == at
    assert by_string.due_at == at
    # Refused before sending, as the scheduler refuses a bad item, and as enqueue_many answers
    # one: a BadRequest (an ApiError) with the reasons by argument.
    with pytest.raises(BadRequest, match="aware") as naive:
        producer.enqueue("shop.send-receipt", run_at=datetime(2030, 1, 1))
    assert "run_at" in naive.value.errors
    with pytest.raises(BadRequest, match="either"):
        producer.enqueue("shop.send-receipt", run_at=at, delay=5)
    with pytest.raises(BadRequest, match="negative"):
        producer.enqueue("shop.send-receipt", delay=-1)
    with pytest.raises(BadRequest) as unencodable:
        producer.enqueue("shop.send-receipt", payload={1, 2})
    assert list(unencodable.value.errors) == ["payload"]


def test_enqueue_without_a_key_makes_one_so_a_retry_cannot_create_a_second_run(producer, team_a):
    make_definition(team_a, "shop.send-receipt", queue="shop")

    run = producer.enqueue("shop.send-receipt")

    assert uuid.UUID(run.idempotency_key)
    assert run.state == "ready"
    assert producer.enqueue("shop.send-receipt").idempotency_key != run.idempotency_key


def test_enqueue_of_an_unknown_job_raises_not_found(producer, team_a):
    with pytest.raises(NotFound):
        producer.enqueue("shop.nothing-here")


def test_enqueue_many_answers_every_item_in_order_across_batches(
    live_server, token_a, team_a, ready_listener
):
    make_definition(team_a, "shop.send-receipt", queue="shop")
    make_definition(team_a, "shop.restock", queue="shop")
    wire = CountingTransport()
    producer = Client(live_server.url, token_a, batch_size=2, http_transport=wire)
    producer.enqueue("shop.send-receipt", payload={"order": 7}, idempotency_key="order-7")

    results = producer.enqueue_many(
        [
            Enqueue("shop.send-receipt", payload={"order": 1}, idempotency_key="order-1"),
            {"job": "shop.restock", "delay": 60, "priority": "bulk"},
            Enqueue("shop.nothing-here"),
            Enqueue("shop.send-receipt", payload={"order": 7}, idempotency_key="order-7"),
            Enqueue("shop.send-receipt", payload={"order": 8}, idempotency_key="order-7"),
        ]
    )

    assert [result.status for result in results] == [201, 201, 404, 200, 409]
    assert [result.ok for result in results] == [True, True, False, True, False]
    assert results[0].created and not results[3].created
    assert results[0].run.payload == {"order": 1}
    assert results[1].run.job == "shop.restock"
    assert results[1].run.priority == "bulk"
    assert results[1].run.state == "scheduled"
    assert isinstance(results[2].error, NotFound) and results[2].run is None
    assert isinstance(results[4].error, IdempotencyConflict)
    assert results[3].run.idempotency_key == "order-7"
    # Five items two at a time, after the one enqueue: four requests.
    assert [path for _, path, _ in wire.seen] == ["/api/v1/runs"] * 4
    assert RunRow.objects.count() == 3
    assert producer.enqueue_many([]) == []
    producer.close()


def test_enqueue_many_can_ask_for_run_ids_alone(producer, team_a, wire):
    make_definition(team_a, "shop.send-receipt", queue="shop")
    producer.enqueue("shop.send-receipt", idempotency_key="order-1")

    results = producer.enqueue_many(
        [
            Enqueue("shop.send-receipt", idempotency_key="order-1"),
            Enqueue("shop.send-receipt", idempotency_key="order-2"),
            Enqueue("shop.nothing-here"),
        ],
        runs=False,
    )

    stored = {row.idempotency_key: row.run_id for row in RunRow.objects.all()}
    assert [(r.status, r.run_id, r.run) for r in results[:2]] == [
        (200, stored["order-1"], None),
        (201, stored["order-2"], None),
    ]
    assert isinstance(results[2].error, NotFound) and results[2].run_id is None
    full = producer.enqueue_many([Enqueue("shop.send-receipt", idempotency_key="order-2")])
    assert full[0].run_id == full[0].run.run_id == stored["order-2"]


def test_enqueue_many_reports_a_bad_item_without_raising(producer, team_a):
    make_definition(team_a, "shop.send-receipt", queue="shop")

    good, bad = producer.enqueue_many(
        [Enqueue("shop.send-receipt"), Enqueue("shop.send-receipt", priority="urgent")]
    )

    assert good.status == 201
    assert bad.status == 400
    assert isinstance(bad.error, BadRequest)
    assert "priority" in bad.error.errors

    # An item the client itself finds wrong is answered in its place too, the others sent.
    before, negative, naive, after = producer.enqueue_many(
        [
            {"job": "shop.send-receipt", "delay": 60},
            {"job": "shop.send-receipt", "delay": -1},
            {"job": "shop.send-receipt", "run_at": datetime(2030, 1, 1)},
            {"job": "shop.send-receipt", "delay": 60},
        ]
    )
    assert (before.status, after.status) == (201, 201)
    for refused, reason in ((negative, "negative"), (naive, "aware")):
        assert refused.status == 400 and isinstance(refused.error, BadRequest)
        assert reason in refused.error.detail and refused.run_id is None
    assert RunRow.objects.count() == 3


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_values_json_or_the_scheduler_cannot_take_are_refused_per_item_not_sent_changed(
    producer, team_a
):
    """NaN and Infinity (orjson would send null), an empty key (not replaced by a made-up
    one), a NUL character and an integer past 64 bits (the scheduler refuses the item alone,
    not the batch): each item is answered in its place, and the others are created."""
    make_definition(team_a, "shop.send-receipt", queue="shop")
    job = "shop.send-receipt"

    results = producer.enqueue_many(
        [
            Enqueue(job, idempotency_key="first"),
            Enqueue(job, payload={"total": float("nan")}),
            Enqueue(job, payload=[float("inf"), None]),
            Enqueue(job, idempotency_key=""),
            Enqueue(job, payload={"note": "a\x00b"}),
            Enqueue(job, payload={"n": 2**70}),
            Enqueue(job, payload=nested(1200)),  # past what JSON encoders write
            Enqueue(job, idempotency_key="last", payload={"kept": None}),
        ]
    )

    assert [result.status for result in results] == [201, 400, 400, 400, 400, 400, 400, 201]
    assert [sorted(result.error.errors) for result in results[1:-1]] == [
        ["payload"],
        ["payload"],
        ["idempotencyKey"],
        ["payload"],
        ["payload"],
        ["payload"],
    ]
    assert results[3].idempotency_key == ""
    assert RunRow.objects.get(idempotency_key="last").payload == {"kept": None}
    assert RunRow.objects.count() == 2
    with pytest.raises(BadRequest) as refused:
        producer.enqueue(job, payload=float("-inf"))
    assert list(refused.value.errors) == ["payload"]


def test_enqueue_many_answers_an_item_it_cannot_send_in_its_place_and_sends_the_others(
    producer, team_a, wire
):
    make_definition(team_a, "shop.send-receipt", queue="shop")
    at = datetime.now(UTC) + timedelta(hours=1)

    results = producer.enqueue_many(
        [
            {"job": "shop.send-receipt", "idempotency_key": "a"},
            {"job": "shop.send-receipt", "idempotencyKey": "x"},  # the JSON's name, not ours
            {"payload": {"order": 1}},  # no job
            "shop.send-receipt",  # not an item at all
            {"job": "shop.send-receipt", "delay": -5},
            {"job": "shop.send-receipt", "delay": 5, "run_at": at},
            {"job": "shop.send-receipt", "delay": "soon"},
            Enqueue("shop.send-receipt", payload={"tags": {1, 2}}),  # a set: not JSON
            {"job": "shop.send-receipt", "idempotency_key": "b"},
        ]
    )

    assert [result.status for result in results] == [201, 400, 400, 400, 400, 400, 400, 400, 201]
    assert [results[0].idempotency_key, results[-1].idempotency_key] == ["a", "b"]
    fields = [sorted(result.error.errors) for result in results[1:-1]]
    assert fields == [
        ["idempotencyKey"],
        ["job"],
        ["item"],
        ["delay"],
        ["delay", "run_at"],
        ["delay"],
        ["payload"],
    ]
    for refused in results[1:-1]:
        assert isinstance(refused.error, BadRequest) and refused.error.status == 400
        assert refused.error.type == "https://docs.cronlease.dev/problems/invalid-input"
        assert refused.error.detail and refused.run_id is None
    assert "negative" in results[4].error.errors["delay"][0]
    # The refused items were not sent: one request, of the two good ones.
    assert wire.seen == [("POST", "/api/v1/runs", 200)]
    assert RunRow.objects.count() == 2


def test_enqueue_many_cuts_batches_by_body_size_and_answers_an_item_too_large_alone(
    producer, team_a, wire
):
    make_definition(team_a, "shop.send-receipt", queue="shop")
    # Each payload is under the scheduler's 1 MiB payload cap; two are over its body limit.
    big = "x" * 600_000

    results = producer.enqueue_many(
        [
            Enqueue("shop.send-receipt", payload={"blob": big}, idempotency_key="big-1"),
            Enqueue("shop.send-receipt", payload={"blob": "x" * 1_100_000}),
            Enqueue("shop.send-receipt", payload={"blob": big}, idempotency_key="big-2"),
            Enqueue("shop.send-receipt", payload={"blob": big}, idempotency_key="big-3"),
            Enqueue("shop.send-receipt", payload={"small": 1}, idempotency_key="small"),
        ],
        runs=False,
    )

    assert [result.status for result in results] == [201, 413, 201, 201, 201]
    too_large = results[1].error
    assert isinstance(too_large, PayloadTooLarge)
    assert too_large.type == "https://docs.cronlease.dev/problems/payload-too-large"
    assert "max_body_bytes" in too_large.detail
    # One big item a request; the small one rides with the last.
    assert wire.seen == [("POST", "/api/v1/runs", 200)] * 3
    assert RunRow.objects.count() == 4


# --- transactions (Django) -------------------------------------------------------------------


def test_a_rolled_back_transaction_enqueues_nothing(producer, team_a):
    make_definition(team_a, "shop.send-receipt", queue="shop")

    class OrderFailed(Exception):
        pass

    with pytest.raises(OrderFailed), transaction.atomic():
        Team.objects.create(slug="order-42", name="the application's own write")
        transaction.on_commit(
            lambda: producer.enqueue("shop.send-receipt", idempotency_key="order-42")
        )
        raise OrderFailed

    assert not RunRow.objects.exists()

    with transaction.atomic():
        Team.objects.create(slug="order-43", name="the application's own write")
        transaction.on_commit(
            lambda: producer.enqueue("shop.send-receipt", idempotency_key="order-43")
        )
        assert not RunRow.objects.exists()  # not before the commit

    assert list(RunRow.objects.values_list("idempotency_key", flat=True)) == ["order-43"]


# --- jobs ------------------------------------------------------------------------------------


def test_put_job_creates_and_replaces_and_get_and_list_answer_it(producer, team_a):
    created = producer.put_job(
        "shop.send-receipt",
        {**DEFINITION, "retry": {"maxAttempts": 5, "baseSeconds": 1, "maxSeconds": 10}},
    )
    assert isinstance(created, Job)
    assert created.name == "shop.send-receipt"
    assert created.queue == "shop"
    assert created.retry == {"maxAttempts": 5, "baseSeconds": 1, "maxSeconds": 10}
    assert created.team == "team-a"
    assert created.created_at.tzinfo is not None

    fetched = producer.get_job("shop.send-receipt")
    replaced = producer.put_job("shop.send-receipt", {**fetched.raw, "timeoutSeconds": 60})
    assert replaced.timeout_seconds == 60
    assert replaced.retry["maxAttempts"] == 5
    assert replaced.rate_limit is None

    limited = producer.put_job(
        "shop.send-receipt", {**fetched.raw, "rateLimit": {"count": 3, "periodSeconds": 60}}
    )
    # Typed as a queue's limit is.
    assert isinstance(limited.rate_limit, RateLimit)
    assert (limited.rate_limit.count, limited.rate_limit.period_seconds) == (3, 60)

    producer.put_job("shop.restock", {"queue": "shop"})
    assert [job.name for job in producer.list_jobs()] == ["shop.restock", "shop.send-receipt"]


def test_a_job_is_changed_only_at_the_version_read_when_if_match_is_given(producer, team_a):
    """Read, change, write back: a pause made by someone else in between refuses the write
    (ChangedMeanwhile, with the version now) rather than being written over."""
    read = producer.put_job("shop.send-receipt", DEFINITION)
    assert read.version.startswith('"') and producer.get_job("shop.send-receipt") == read
    assert producer.get_job("shop.send-receipt").version == read.version
    paused = producer.pause_job("shop.send-receipt")  # someone else, meanwhile
    with pytest.raises(ChangedMeanwhile) as refused:
        producer.put_job(
            "shop.send-receipt", {**read.raw, "timeoutSeconds": 5}, if_match=read.version
        )
    assert refused.value.status == 412 and refused.value.version == paused.version
    assert producer.get_job("shop.send-receipt").timeout_seconds == read.timeout_seconds
    with pytest.raises(ChangedMeanwhile):
        producer.resume_job("shop.send-receipt", if_match=read.version)
    with pytest.raises(ChangedMeanwhile):
        producer.put_job("shop.send-receipt", DEFINITION, create_only=True)

    current = producer.get_job("shop.send-receipt")
    written = producer.put_job(
        "shop.send-receipt", {**current.raw, "timeoutSeconds": 5}, if_match=current.version
    )
    assert written.timeout_seconds == 5 and written.paused  # the pause left unsaid is kept
    with pytest.raises(ChangedMeanwhile):
        producer.delete_job("shop.send-receipt", if_match=current.version)
    assert producer.delete_job("shop.send-receipt", if_match=written.version) is None
    with pytest.raises(NotFound):
        producer.get_job("shop.send-receipt")


def test_apply_jobs_previews_with_dry_run_then_applies_and_prunes(producer, team_a):
    make_definition(team_a, "shop.old-report", queue="shop")

    preview = producer.apply_jobs([DEFINITION], prune=True, dry_run=True)
    assert not preview.applied
    assert preview.summary == {"create": 1, "update": 0, "delete": 1, "unchanged": 0}
    assert {(c.action, c.name) for c in preview.changes} == {
        ("create", "shop.send-receipt"),
        ("delete", "shop.old-report"),
    }
    assert [job.name for job in producer.list_jobs()] == ["shop.old-report"]

    applied = producer.apply_jobs([DEFINITION], prune=True)
    assert applied.applied
    assert [job.name for job in producer.list_jobs()] == ["shop.send-receipt"]

    updated = producer.apply_jobs([{**DEFINITION, "timeoutSeconds": 30}])
    (change,) = updated.changes
    assert change.action == "update"
    assert change.fields["timeoutSeconds"] == {"before": 3600, "after": 30}


def test_pause_resume_and_trigger_a_job(producer, team_a):
    make_definition(team_a, "shop.send-receipt", queue="shop")

    assert producer.pause_job("shop.send-receipt").paused is True
    assert producer.get_job("shop.send-receipt").paused is True
    assert producer.resume_job("shop.send-receipt").paused is False

    run = producer.trigger_job("shop.send-receipt")
    assert run.trigger == "api"
    assert run.state == "ready"
    assert RunRow.objects.count() == 1


def test_preview_lists_the_next_fire_times(producer, team_a):
    make_definition(
        team_a,
        "shop.nightly",
        queue="shop",
        schedule={"cron": "0 2 * * *", "timeZone": "Europe/Berlin", "jitterSeconds": 0},
    )

    times = producer.preview("shop.nightly", count=3, from_=datetime(2026, 3, 27, tzinfo=UTC))

    assert len(times) == 3
    assert all(isinstance(time, FireTime) for time in times)
    assert times[0].local.isoformat() == "2026-03-27T02:00:00+01:00"
    assert times[2].local.isoformat() == "2026-03-29T03:00:00+02:00"
    assert "DST" in times[2].note
    assert times[0].utc == datetime(2026, 3, 27, 1, tzinfo=UTC)


# --- runs ------------------------------------------------------------------------------------


def test_runs_follows_next_over_several_pages(producer, team_a, wire):
    definition = make_definition(team_a, "shop.send-receipt", queue="shop")
    other = make_definition(team_a, "shop.restock", queue="shop")
    ids = add_ready_runs(definition, 120)
    add_ready_runs(other, 3, prefix="o")

    runs = list(producer.runs(job="shop.send-receipt", page_size=50))

    assert [run.run_id for run in runs] == [public_run_id(pk) for pk in sorted(ids, reverse=True)]
    assert all(run.state == "ready" for run in runs)
    assert wire.seen == [("GET", "/api/v1/runs", 200)] * 3
    assert len(list(producer.runs(page_size=500))) == 123
    assert list(producer.runs(state="succeeded")) == []
    assert (
        len(list(producer.runs(queue="shop", since=datetime.now(UTC) - timedelta(hours=1)))) == 123
    )


def test_get_run_answers_its_attempts(producer, api_a, team_a):
    definition = make_definition(team_a, "shop.send-receipt", queue="shop", retry_max_attempts=3)
    (pk,) = add_ready_runs(definition, 1)
    (run_id,) = lease_and_fail(api_a, "shop", 1, retryable=True)
    assert run_id == public_run_id(pk)

    run = producer.get_run(run_id)

    assert run.state == "retrying"
    assert run.attempt == 1
    (attempt,) = run.attempts
    assert attempt.outcome == "failed"
    assert attempt.worker_id == "test-worker"
    assert attempt.error == {"message": "upstream down", "type": "IOError"}
    assert attempt.leased_at <= attempt.ended_at
    assert run.last_error["message"] == "upstream down"


def test_retry_and_cancel_a_run(producer, api_a, team_a):
    definition = make_definition(team_a, "shop.send-receipt", queue="shop", retry_max_attempts=3)
    add_ready_runs(definition, 1)
    (run_id,) = lease_and_fail(api_a, "shop", 1, retryable=True)

    assert producer.retry_run(run_id).state == "ready"
    cancelled = producer.cancel_run(run_id)
    assert cancelled.state == "cancelled"
    with pytest.raises(Conflict) as caught:
        producer.cancel_run(run_id)
    assert caught.value.status == 409
    assert not isinstance(caught.value, IdempotencyConflict)


# --- dead-letter queue -----------------------------------------------------------------------


def test_dlq_lists_requeues_and_discards(producer, api_a, team_a):
    definition = make_definition(team_a, "shop.send-receipt", queue="shop", retry_max_attempts=1)
    add_ready_runs(definition, 3)
    dead = lease_and_fail(api_a, "shop", 3, retryable=False)

    listed = list(producer.dlq(job="shop.send-receipt", page_size=2))
    assert sorted(run.run_id for run in listed) == sorted(dead)
    assert all(run.state == "dead" for run in listed)

    requeued = producer.requeue([dead[0]])
    assert requeued.count == 1
    assert requeued.run_ids == (dead[0],)
    assert producer.get_run(dead[0]).state == "ready"

    discarded = producer.discard(filter={"job": "shop.send-receipt"})
    assert discarded.count == 2
    assert sorted(discarded.run_ids) == sorted(dead[1:])
    assert list(producer.dlq()) == []

    with pytest.raises(ValueError):
        producer.requeue()
    with pytest.raises(ValueError):
        producer.discard([dead[0]], filter={"all": True})
    with pytest.raises(BadRequest) as caught:
        producer.requeue(filter={})
    assert "filter" in caught.value.errors


# --- queues ----------------------------------------------------------------------------------


def test_queues_pause_and_resume(producer, team_a):
    definition = make_definition(team_a, "shop.send-receipt", queue="shop")
    add_ready_runs(definition, 2)

    (queue,) = [q for q in producer.queues() if q.name == "shop"]
    assert queue.paused is False
    assert sum(queue.depth.values()) == 2
    assert queue.oldest_ready_at is not None

    assert producer.pause_queue("shop").paused is True
    assert [q.paused for q in producer.queues() if q.name == "shop"] == [True]
    assert producer.resume_queue("shop").paused is False


def test_a_queue_rate_limit_is_set_read_and_lifted(producer, live_server, token_a, team_a):
    make_definition(team_a, "shop.send-receipt", queue="shop")
    (before,) = [q for q in producer.queues() if q.name == "shop"]
    assert (before.rate_limit, before.rate_used) == (None, None)

    limited = producer.set_queue_rate_limit("shop", 5, 60)

    assert (limited.rate_limit.count, limited.rate_limit.period_seconds) == (5, 60)
    assert limited.rate_used == 0
    assert limited.paused is False
    (listed,) = [q for q in producer.queues() if q.name == "shop"]
    assert listed.rate_limit == limited.rate_limit
    assert listed.raw["rateLimit"] == {"count": 5, "periodSeconds": 60}
    with pytest.raises(BadRequest) as bad:
        producer.set_queue_rate_limit("shop", 0, 60)
    assert "rateLimit.count" in bad.value.errors
    with pytest.raises(ValueError):
        producer.set_queue_rate_limit("shop", 5)

    async def lift() -> tuple:
        async with AsyncClient(live_server.url, token_a) as client:
            lifted = await client.set_queue_rate_limit("shop", None)
            return lifted, [q for q in await client.queues() if q.name == "shop"]

    lifted, (listed,) = run_coroutine(lift())
    assert (lifted.rate_limit, lifted.rate_used) == (None, None)
    assert listed.rate_limit is None


# --- errors ----------------------------------------------------------------------------------


def test_each_problem_has_its_error_class(live_server, producer, team_a, ready_listener):
    make_definition(team_a, "shop.send-receipt", queue="shop")

    with pytest.raises(BadRequest) as bad:
        producer.put_job("shop.send-receipt", {"queue": "shop", "retry": {"maxAttempts": 0}})
    assert bad.value.status == 400
    assert "retry.maxAttempts" in bad.value.errors

    with pytest.raises(NotFound):
        producer.get_run("run_nothing")
    with pytest.raises(NotFound):
        producer.get_job("shop.nothing-here")

    with pytest.raises(PayloadTooLarge):
        producer.put_job("shop.send-receipt", {"queue": "shop", "payload": "x" * 1_200_000})

    with Client(live_server.url, "jst_not-a-token") as stranger, pytest.raises(Unauthorized):
        stranger.list_jobs()

    worker_only = ApiToken.issue(team_a, ["worker"])[1]
    with Client(live_server.url, worker_only) as worker, pytest.raises(Forbidden) as refused:
        worker.list_jobs()
    assert isinstance(refused.value, ApiError)
    assert refused.value.status == 403
    assert refused.value.title


def test_throttled_calls_wait_out_retry_after_and_succeed(
    live_server, token_a, team_a, ready_listener, settings
):
    make_definition(team_a, "shop.send-receipt", queue="shop")
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "2/s"}
    wire = CountingTransport()
    producer = Client(live_server.url, token_a, retries=5, http_transport=wire)

    started = time.monotonic()
    names = [producer.get_job("shop.send-receipt").name for _ in range(5)]
    elapsed = time.monotonic() - started

    assert names == ["shop.send-receipt"] * 5
    throttled = [status for _, _, status in wire.seen if status == 429]
    assert throttled  # five calls at 2/s: some were refused, then waited out
    assert elapsed >= 1.0 * len(throttled) - 0.05  # each waited the Retry-After of 1 s
    producer.close()

    # Fresh tokens: each has a budget of its own.
    with Client(live_server.url, manage_token(team_a), retries=0) as impatient:
        impatient.get_job("shop.send-receipt")
        impatient.get_job("shop.send-receipt")
        with pytest.raises(RateLimited) as caught:
            for _ in range(3):
                impatient.get_job("shop.send-receipt")
    assert caught.value.status == 429
    assert caught.value.retry_after >= 1

    # A wait longer than the client accepts is not waited out.
    with Client(live_server.url, manage_token(team_a), max_retry_wait=0.5) as hurried:
        started = time.monotonic()
        with pytest.raises(RateLimited):
            for _ in range(3):
                hurried.get_job("shop.send-receipt")
        assert time.monotonic() - started < 1.0


def test_enqueue_over_the_runs_budget_waits_for_the_next_window_and_creates_each_run_once(
    live_server, token_a, team_a, ready_listener, settings
):
    make_definition(team_a, "shop.send-receipt", queue="shop")
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "", "enqueue": "3/s"}
    wire = CountingTransport()
    producer = Client(live_server.url, token_a, batch_size=2, retries=5, http_transport=wire)

    # Start as a second begins: the 429 below is then certain (the budget slides over the
    # last second, counted in tenths).
    second = datetime.now(UTC).replace(microsecond=20_000) + timedelta(seconds=2)
    with time_machine.travel(second, tick=True):
        results = producer.enqueue_many([Enqueue("shop.send-receipt") for _ in range(5)])

    assert [result.status for result in results] == [201] * 5
    # The second batch would pass 3 runs in the second: refused whole, then sent again.
    assert 429 in [status for _, _, status in wire.seen]
    assert RunRow.objects.count() == 5
    producer.close()


def test_enqueue_many_halves_a_batch_larger_than_the_whole_budget(
    live_server, token_a, team_a, ready_listener, settings
):
    """A batch the token could never send in one period (batch-over-rate) is sent in halves,
    and each half waits its turn: before, it was told to retry in a second, forever."""
    make_definition(team_a, "shop.send-receipt", queue="shop")
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "", "enqueue": "20/s"}
    wire = CountingTransport()
    producer = Client(live_server.url, token_a, batch_size=30, retries=5, http_transport=wire)

    results = producer.enqueue_many([Enqueue("shop.send-receipt") for _ in range(30)])

    assert [result.status for result in results] == [201] * 30
    assert [status for _, _, status in wire.seen][0] == 400
    assert RunRow.objects.count() == 30
    producer.close()


# --- the async client ------------------------------------------------------------------------


def test_the_async_client_enqueues_manages_and_pages(live_server, token_a, team_a, ready_listener):
    definition = make_definition(team_a, "shop.send-receipt", queue="shop")
    add_ready_runs(definition, 7)

    async def produce() -> dict:
        async with AsyncClient(live_server.url, token_a, batch_size=2) as producer:
            job = await producer.put_job("shop.restock", {"queue": "shop"})
            run = await producer.enqueue("shop.restock", delay=30, idempotency_key="k-1")
            many = await producer.enqueue_many(
                [Enqueue("shop.restock", idempotency_key=f"k-{n}") for n in range(1, 4)]
            )
            listed = [run async for run in producer.runs(job="shop.send-receipt", page_size=3)]
            try:
                await producer.get_run("run_nothing")
            except NotFound as exc:
                missing = exc
            return {"job": job, "run": run, "many": many, "listed": listed, "missing": missing}

    done = run_coroutine(produce())

    assert done["job"].name == "shop.restock"
    assert done["run"].state == "scheduled"
    assert [result.status for result in done["many"]] == [200, 201, 201]
    assert len(done["listed"]) == 7
    assert isinstance(done["missing"], NotFound)


# --- retries, against a scripted transport (no server) ---------------------------------------


def scripted(
    *answers: Callable[[httpx.Request], httpx.Response], client_class=Client, **options
) -> tuple[Client, list[httpx.Request]]:
    """A client whose n-th request gets the n-th answer (the last one repeats)."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers[min(len(seen), len(answers)) - 1](request)

    options.setdefault("backoff_base", 0.001)
    options.setdefault("backoff_cap", 0.01)
    # MockTransport serves httpx.Client and httpx.AsyncClient alike.
    transport = httpx.MockTransport(handle)
    return client_class(
        "http://scheduler.test/", "jst_x", http_transport=transport, **options
    ), seen


def problem(code: int, **headers: str) -> Callable[[httpx.Request], httpx.Response]:
    body = {"type": "https://x/problems/p", "title": "t", "status": code, "detail": f"{code}"}
    return lambda request: httpx.Response(code, json=body, headers=headers)


RUN = {"runId": "run_1", "job": "shop.send-receipt", "state": "ready", "idempotencyKey": "k"}


def created(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"runs": [{"status": 201, "run": RUN}]})


def a_run(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=RUN)


def refuse_connection(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def lose_the_answer(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadError("connection reset", request=request)


def test_unavailable_is_retried_after_its_retry_after():
    producer, seen = scripted(problem(503, **{"Retry-After": "0.2"}), a_run)
    started = time.monotonic()
    assert producer.get_run("run_1").run_id == "run_1"
    assert time.monotonic() - started >= 0.2
    assert len(seen) == 2


def test_retries_are_bounded():
    producer, seen = scripted(problem(503), retries=2)
    with pytest.raises(Unavailable):
        producer.get_job("shop.send-receipt")
    assert len(seen) == 3


def test_a_lost_answer_is_retried_for_enqueue_with_the_same_generated_key():
    producer, seen = scripted(lose_the_answer, created)
    assert producer.enqueue("shop.send-receipt").run_id == "run_1"
    first, second = (request.content for request in seen)
    assert first == second
    assert b'"idempotencyKey"' in first


def test_a_lost_answer_is_not_retried_for_a_call_that_is_not_idempotent():
    producer, seen = scripted(lose_the_answer, a_run)
    with pytest.raises(NetworkError) as caught:
        producer.trigger_job("shop.send-receipt")
    assert caught.value.status is None and caught.value.sent
    assert len(seen) == 1


def test_a_delete_whose_answer_was_lost_is_done_when_the_retry_finds_the_job_gone():
    """The first try deleted the job and its answer was lost: the retry's 404 is that delete's
    outcome, not an error (before: NotFound, as if there had been nothing to delete)."""
    producer, seen = scripted(lose_the_answer, problem(404))
    assert producer.delete_job("shop.send-receipt") is None
    assert len(seen) == 2
    producer, seen = scripted(problem(404))  # a first try's 404 is a job that was not there
    with pytest.raises(NotFound):
        producer.delete_job("shop.send-receipt")


def test_what_no_job_or_json_can_be_is_refused_before_anything_is_sent():
    """ "." was a path segment to the URL (put_job(".", …) became a PUT of /api/v1/jobs, the
    jobs-as-code sync); NaN was written as null."""
    producer, seen = scripted(a_run)
    for call in (
        lambda: producer.put_job(".", {"jobs": [], "prune": True}),
        lambda: producer.delete_job(".."),
        lambda: producer.pause_job("."),
        lambda: producer.put_job("shop.x", {"queue": "q", "payload": {"x": float("nan")}}),
        lambda: producer.apply_jobs([{"name": "shop.x", "queue": "q", "payload": {1, 2}}]),
        lambda: producer.put_job("shop.x", {"queue": "q"}, if_match='"v"', create_only=True),
    ):
        with pytest.raises(ValueError):
            call()
    assert seen == []


def test_a_refused_connection_is_retried_for_any_call():
    producer, seen = scripted(refuse_connection, a_run)
    assert producer.cancel_run("run_1").run_id == "run_1"
    assert len(seen) == 2


def test_gateway_errors_are_retried_only_for_idempotent_calls():
    producer, seen = scripted(problem(502), a_run)
    assert producer.get_run("run_1").run_id == "run_1"
    producer, seen = scripted(problem(502), a_run)
    with pytest.raises(ApiError) as caught:
        producer.retry_run("run_1")
    assert caught.value.status == 502
    assert len(seen) == 1


def test_a_batch_that_fails_part_way_raises_with_the_results_of_the_batches_before():
    def first_batch_only(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)["runs"]
        return httpx.Response(200, json={"runs": [{"status": 201, "run": RUN} for _ in sent]})

    producer, seen = scripted(first_batch_only, problem(401), batch_size=2)
    with pytest.raises(Unauthorized) as caught:
        producer.enqueue_many([Enqueue("shop.send-receipt") for _ in range(5)])

    assert len(seen) == 2
    sent_keys = [item["idempotencyKey"] for item in json.loads(seen[0].content)["runs"]]
    assert [result.idempotency_key for result in caught.value.enqueued] == sent_keys
    assert all(result.created for result in caught.value.enqueued)


def test_the_async_client_retries_as_the_sync_one_does():
    producer, seen = scripted(
        problem(429, **{"Retry-After": "0"}), refuse_connection, a_run, client_class=AsyncClient
    )

    async def fetch() -> Run:
        async with producer:
            return await producer.get_run("run_1")

    assert run_coroutine(fetch()).run_id == "run_1"
    assert len(seen) == 3


def body(content: bytes) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(200, content=content)


# (a call, a 200 body that is not its answer); `runs()` and `dlq()` answer an iterator.
GARBLED = [
    pytest.param(lambda client: client.list_jobs(), b"null", id="list_jobs"),
    pytest.param(lambda client: client.list_jobs(), b'{"results":[1]}', id="list_jobs"),
    pytest.param(lambda client: client.runs(), b'{"results":"x"}', id="runs"),
    pytest.param(lambda client: client.dlq(), b'{"results":[],"next":3}', id="dlq"),
    pytest.param(lambda client: client.get_run("run_1"), b"[1,2]", id="get_run"),
    pytest.param(lambda client: client.get_run("run_1"), b'{"foo":1}', id="get_run"),
    pytest.param(lambda client: client.get_job("shop.send-receipt"), b"", id="get_job"),
    pytest.param(
        lambda client: client.get_job("shop.send-receipt"),
        b"<html>proxy error</html>",
        id="get_job",
    ),
    pytest.param(
        lambda client: client.enqueue("shop.send-receipt"),
        b'{"runs":[{"run":{"foo":1}}]}',
        id="enqueue",
    ),
    pytest.param(lambda client: client.enqueue("shop.send-receipt"), b'{"runs":[]}', id="enqueue"),
    pytest.param(
        lambda client: client.enqueue_many([Enqueue("shop.send-receipt")]),
        b'{"runs":[7]}',
        id="enqueue_many",
    ),
    pytest.param(lambda client: client.queues(), b'{"results":[{"name":"shop"}]}', id="queues"),
    pytest.param(
        lambda client: client.preview("shop.send-receipt"), b'{"times":null}', id="preview"
    ),
    pytest.param(lambda client: client.apply_jobs([]), b"{}", id="apply_jobs"),
    pytest.param(lambda client: client.requeue(["run_1"]), b'{"count":"1"}', id="requeue"),
    pytest.param(lambda client: client.trigger_job("shop.send-receipt"), b'"ok"', id="trigger_job"),
]


@pytest.mark.parametrize(("call", "content"), GARBLED)
def test_a_success_answer_not_of_its_shape_raises_bad_answer(call, content):
    producer, seen = scripted(body(content), retries=0)

    with pytest.raises(BadAnswer) as caught:
        value = call(producer)
        if isinstance(value, Iterator):
            list(value)

    assert isinstance(caught.value, ApiError)
    assert caught.value.status == 200 and caught.value.transient
    assert repr(content[:100]) in caught.value.detail
    assert len(seen) == 1


@pytest.mark.parametrize(("call", "content"), GARBLED)
def test_the_async_client_raises_bad_answer_for_the_same_answers(call, content):
    producer, _ = scripted(body(content), client_class=AsyncClient, retries=0)

    async def send() -> None:
        async with producer:
            value = call(producer)
            if hasattr(value, "__aiter__"):
                return [item async for item in value]
            return await value

    with pytest.raises(BadAnswer) as caught:
        run_coroutine(send())
    assert caught.value.status == 200


def test_a_garbled_answer_is_retried_for_idempotent_calls_only():
    producer, seen = scripted(body(b"<html>"), a_run)
    assert producer.get_run("run_1").run_id == "run_1"
    assert len(seen) == 2

    producer, seen = scripted(body(b"<html>"), a_run)
    with pytest.raises(BadAnswer):
        producer.trigger_job("shop.send-receipt")
    assert len(seen) == 1


def test_enqueue_many_keeps_every_request_under_max_body_bytes():
    def answer_each(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)["runs"]
        return httpx.Response(200, json={"runs": [{"status": 201, "run": RUN} for _ in sent]})

    producer, seen = scripted(answer_each, max_body_bytes=2048, batch_size=3)
    items = [
        Enqueue("shop.send-receipt", payload="x" * size, idempotency_key=f"k-{n}")
        for n, size in enumerate([900, 900, 100, 100, 100, 100, 2100, 1900, 10])
    ]

    results = producer.enqueue_many(items)

    assert [result.status for result in results] == [201] * 6 + [413, 201, 201]
    assert all(len(request.content) <= 2048 for request in seen)
    batches = [[item["idempotencyKey"] for item in json.loads(r.content)["runs"]] for r in seen]
    # The items' JSON is 963, 963, 163 (x4), 2 163, 1 963 and 73 bytes: two 963s fill a
    # request; three small ones make a batch (batch_size); the 2 163 is over the limit alone
    # (413, not sent); the 1 963 and the 73 make exactly 2 048 with `{"runs":[`, `,` and `]}`.
    assert batches == [["k-0", "k-1"], ["k-2", "k-3", "k-4"], ["k-5"], ["k-7", "k-8"]]
