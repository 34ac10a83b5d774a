"""Worker faults with real worker processes (`python -m cronlease_client run`) on the shared API
server and reaper: killed, frozen, poisoned, restarted one by one, holding a concurrency slot,
working a queue that gets paused. Every outcome is read back from the database.
"""

from __future__ import annotations

import signal
import time

import pytest

from apps.runs.ids import public_run_id
from tests.faults.helpers import Proc, all_in, attempts_of, runs, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.shards,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]

# The first attempt of these runs outlives any test; later attempts are quick.
LONG_FIRST = {"seconds": 0.2, "firstAttemptSeconds": 60}


def leased_by(db, ids, worker_id: str) -> dict[int, int] | None:
    """{run id: fencing token} once every one of these runs is leased by `worker_id`."""
    found = runs(db, ids)
    if len(found) == len(ids) and all(
        run["state"] == "leased" and run["worker_id"] == worker_id for run in found.values()
    ):
        return {pk: run["fencing_token"] for pk, run in found.items()}
    return None


@pytest.mark.shards
def test_a_sigkilled_workers_runs_are_leased_again_with_larger_tokens_or_die_when_spent(
    harness,
):
    h = harness
    retried = h.definition("faults.work", "kill", retry_max_attempts=3)
    spent = h.definition("faults.spent", "kill", retry_max_attempts=1)
    retried_ids = h.add_runs(retried, [LONG_FIRST] * 6)
    spent_ids = h.add_runs(spent, [LONG_FIRST] * 2, prefix="spent")
    victim = h.worker("victim", "kill", concurrency=8)
    first_tokens = wait_for(
        lambda: leased_by(h.db, retried_ids + spent_ids, "victim"), 30, "the victim's leases"
    )

    # The rescuer starts while the victim still holds every run; then the victim is killed.
    h.worker("rescuer", "kill", concurrency=4)
    victim.kill()
    wait_for(
        lambda: all_in(h.db, retried_ids, "succeeded") and all_in(h.db, spent_ids, "dead"),
        30,
        "the rescue",
    )

    effects = h.effects()
    for pk, run in runs(h.db, retried_ids).items():
        attempts = attempts_of(h.db, pk)
        assert attempts[0] == (1, first_tokens[pk], "victim", "lease_expired", "lease_expired")
        assert attempts[-1][3] == "succeeded"
        assert attempts[-1][1] == run["fencing_token"] > first_tokens[pk]
        assert run["result"]["token"] == run["fencing_token"]
        assert effects[run["idempotency_key"]]["fencing_token"] == run["fencing_token"]
    for pk, run in runs(h.db, spent_ids).items():
        assert attempts_of(h.db, pk) == [
            (1, first_tokens[pk], "victim", "lease_expired", "lease_expired")
        ]
        assert (run["attempt"], run["last_error"]["type"]) == (1, "lease_expired")
        assert run["idempotency_key"] not in effects
    h.check()


def test_a_frozen_worker_loses_its_leases_and_is_refused_when_it_wakes(harness):
    h = harness
    definition = h.definition("faults.work", "freeze", retry_max_attempts=3)
    # The first attempts belong to the worker that will freeze; the second ones to the rescuer,
    # which holds the long run for 3 s: long enough to be holding it when the sleeper wakes.
    long_run, short_run = h.add_runs(
        definition,
        [{"seconds": 3, "firstAttemptSeconds": 60}, {"seconds": 0.2, "firstAttemptSeconds": 1}],
    )
    sleeper = h.worker("sleeper", "freeze", concurrency=2)
    old = wait_for(lambda: leased_by(h.db, [long_run, short_run], "sleeper"), 30, "leases")

    sleeper.signal(signal.SIGSTOP)
    try:
        h.worker("rescuer", "freeze", concurrency=2)

        def reassigned() -> bool:
            found = runs(h.db, [long_run, short_run])
            return (found[long_run]["state"], found[long_run]["worker_id"]) == (
                "leased",
                "rescuer",
            ) and found[short_run]["state"] == "succeeded"

        wait_for(reassigned, 30, "the rescuer to hold the long run and finish the short one")
        before = runs(h.db, [long_run])[long_run]
        assert before["fencing_token"] > old[long_run]

        # The frozen worker's token is stale: every call it could make is refused.
        with h.http() as http:
            run_id = public_run_id(long_run)
            for call, body in [
                ("heartbeat", {}),
                ("complete", {"result": {"late": True}}),
                ("fail", {"error": {"message": "late", "type": "Late"}, "retryable": True}),
            ]:
                answer = http.post(
                    f"/api/v1/runs/{run_id}/{call}",
                    json={"fencingToken": old[long_run], **body},
                )
                assert answer.status_code == 409, (call, answer.text)
        after = runs(h.db, [long_run])[long_run]
        assert (after["state"], after["fencing_token"], after["attempt"]) == (
            "leased",
            before["fencing_token"],
            2,
        )
    finally:
        sleeper.signal(signal.SIGCONT)

    # Awake, the sleeper heartbeats with its old tokens: refused, it drops the runs.
    wait_for(
        lambda: f"lease lost run_id={public_run_id(long_run)}" in sleeper.output(),
        15,
        "the sleeper to learn its lease is lost",
    )
    wait_for(lambda: all_in(h.db, [long_run, short_run], "succeeded"), 15, "both runs to finish")
    assert sleeper.alive()

    effects = h.effects()
    for pk, run in runs(h.db, [long_run, short_run]).items():
        (first, second) = attempts_of(h.db, pk)
        assert first == (1, old[pk], "sleeper", "lease_expired", "lease_expired")
        assert second == (2, run["fencing_token"], "rescuer", "succeeded", "")
        assert run["result"]["token"] == run["fencing_token"]
        # The sleeper's late write (the short run's handler finished while frozen) was fenced.
        assert effects[run["idempotency_key"]]["fencing_token"] == run["fencing_token"]
    h.check()


def test_a_job_that_kills_its_worker_every_time_ends_in_the_dlq_after_max_attempts(harness):
    h = harness
    poison = h.definition("faults.poison", "poison", retry_max_attempts=3)
    healthy = h.definition("faults.work", "poison")
    (pk,) = h.add_runs(poison, [{}])

    # A supervisor's job, done by the test: two workers stay up; whenever one dies, another
    # starts (while the survivor, already polling, is the one to get the run next).
    started = 0
    deaths: list[tuple[str, int]] = []

    def start() -> Proc:
        nonlocal started
        started += 1
        return h.worker(f"poisoned-{started}", "poison", lease=1)

    workers = [start(), start()]
    deadline = time.monotonic() + 40
    while not all_in(h.db, [pk], "dead"):
        assert time.monotonic() < deadline, f"still {runs(h.db, [pk])[pk]['state']}"
        for index, worker in enumerate(workers):
            if not worker.alive():
                deaths.append((worker.name, worker.wait(5)))
                workers[index] = start()
        time.sleep(0.05)

    attempts = attempts_of(h.db, pk)
    assert [(n, o) for n, _, _, o, _ in attempts] == [
        (1, "lease_expired"),
        (2, "lease_expired"),
        (3, "lease_expired"),
    ]
    # Every attempt went to a worker that died of it (or, see the test below, to a worker
    # already dead whose long poll was still running); no other worker died, each exited 1.
    dead = {name for name, _ in deaths}
    assert {w for _, _, w, _, _ in attempts} <= dead
    assert len(deaths) <= 3 and all(code == 1 for _, code in deaths)
    # No endless rescue: the queue goes on (a healthy run succeeds on the surviving worker),
    # while the dead run stays dead, listed in the DLQ, with no fourth attempt.
    (ok,) = h.add_runs(healthy, [{"seconds": 0.1}], prefix="healthy")
    wait_for(lambda: all_in(h.db, [ok], "succeeded"), 20, "the healthy run")
    assert all(worker.alive() for worker in workers)
    run = runs(h.db, [pk])[pk]
    assert (run["state"], run["attempt"], run["max_attempts"]) == ("dead", 3, 3)
    with h.http() as http:
        listed = http.get("/api/v1/dlq").json()
    assert [item["runId"] for item in listed["results"]] == [public_run_id(pk)]
    h.check()


# What a stopped worker's attempts end as: finished; or handed back, by the worker (runs it had
# not finished in its grace period, or leased in an answer that came after the stop) or by the
# API server (runs of an answer it had not sent when the stop hung up the long poll).
HANDED_BACK = {("succeeded", ""), ("failed", "WorkerShutdown"), ("failed", "WorkerGone")}


@pytest.mark.shards
def test_a_rolling_restart_of_every_worker_loses_no_run(harness):
    h = harness
    definition = h.definition("faults.work", "roll", retry_max_attempts=5)
    ids = h.add_runs(definition, [{"seconds": 0.5}] * 54)
    options = {"concurrency": 2, "lease": 3, "grace": 10}
    old = [h.worker(f"roll-{i}", "roll", **options) for i in range(3)]
    wait_for(
        lambda: all(
            h.db.scalar("SELECT count(*) FROM runs_attempt WHERE worker_id = %s", [worker.name])
            for worker in old
        ),
        30,
        "every worker to be busy",
    )

    for worker in old:
        h.worker(f"{worker.name}-new", "roll", **options)
        # In flight at SIGTERM: this worker's runs must finish (or be handed back) before it exits.
        in_flight = wait_for(
            lambda w=worker: h.db.rows(
                "SELECT id FROM runs_run WHERE state = 'leased' AND worker_id = %s", [w.name]
            ),
            10,
            f"{worker.name} to have runs in flight",
            interval=0.02,
        )
        worker.signal(signal.SIGTERM)
        assert worker.wait(20) == 0
        # Its attempts are over: finished, or handed back for another worker to retry.
        ended = h.db.rows(
            "SELECT outcome, error_type FROM runs_attempt WHERE worker_id = %s AND run_id = ANY(%s)",
            [worker.name, [pk for (pk,) in in_flight]],
        )
        assert len(ended) == len(in_flight)
        assert set(ended) <= HANDED_BACK, ended

    wait_for(lambda: all_in(h.db, ids, "succeeded"), 60, "every run to succeed")
    outcomes = h.db.rows(
        "SELECT outcome, error_type, count(*) FROM runs_attempt a JOIN runs_run r"
        " ON r.id = a.run_id WHERE r.definition_id = %s GROUP BY 1, 2",
        [definition.pk],
    )
    # Nothing was left for the reaper: every attempt finished or was handed back at shutdown.
    assert {(outcome, error_type) for outcome, error_type, _ in outcomes} <= HANDED_BACK
    effects = h.effects()
    for run in runs(h.db, ids).values():
        assert effects[run["idempotency_key"]]["fencing_token"] == run["fencing_token"]
    assert len(effects) == len(ids)
    h.check()


def test_a_dead_holders_concurrency_slot_frees_once_and_the_limit_always_holds(harness):
    h = harness
    definition = h.definition("faults.limited", "limited", concurrency=2, retry_max_attempts=3)
    held = h.add_runs(definition, [LONG_FIRST] * 2, prefix="held")
    rest = h.add_runs(definition, [{"seconds": 0.3}] * 6, prefix="rest")
    # The holder starts first and takes the two oldest (it asks for four; the limit gives two).
    # Started together, two claims could cross and split the held runs between the workers:
    # one locks the oldest as a candidate, the other skips it and takes the next, and each is
    # under the limit; or the slots free one at a time after newer runs went first. Which
    # worker then held what was a race the test lost about once in a dozen runs.
    name = "w-1"
    workers = {name: h.worker(name, "limited", concurrency=4, lease=3)}
    old = wait_for(lambda: leased_by(h.db, held, name), 30, "the slots to be taken")
    workers["w-2"] = h.worker("w-2", "limited", concurrency=4, lease=3)
    wait_for(
        lambda: h.db.scalar("SELECT count(*) FROM runs_worker WHERE worker_id = 'w-2'") == 1,
        30,
        "the second worker to ask for work",
    )
    before = {pk: (run["state"], run["attempt"]) for pk, run in runs(h.db, rest).items()}
    time.sleep(1)  # both workers keep asking; the limit keeps saying no
    assert {pk: (run["state"], run["attempt"]) for pk, run in runs(h.db, rest).items()} == before
    assert all(state != "leased" for state, _ in before.values())

    workers[name].kill()
    wait_for(lambda: all_in(h.db, held + rest, "succeeded"), 40, "every run to succeed")

    # The dead holder's slots were freed once each, by the reaper; its late calls change nothing.
    with h.http() as http:
        for pk, token in old.items():
            late = http.post(
                f"/api/v1/runs/{public_run_id(pk)}/complete", json={"fencingToken": token}
            )
            assert late.status_code == 409
            first, second = attempts_of(h.db, pk)
            assert first == (1, token, name, "lease_expired", "lease_expired")
            assert second[3] == "succeeded"
    peaks = h.check()
    # The limit was reached again after the holder died, and never exceeded.
    assert peaks[definition.pk] == 2


def test_a_paused_queue_finishes_in_flight_runs_leases_nothing_new_and_stays_paused_across_restarts(
    harness,
):
    h = harness
    definition = h.definition("faults.work", "pausable")
    first = h.add_runs(definition, [{"seconds": 1.5}] * 2, prefix="first")
    rest = h.add_runs(definition, [{"seconds": 0.1}] * 4, prefix="rest")
    worker = h.worker("pause-1", "pausable", concurrency=2)
    wait_for(lambda: leased_by(h.db, first, "pause-1"), 30, "the first runs in flight")

    with h.http() as http:
        assert http.post("/api/v1/queues/pausable/pause").status_code == 200
    assert {pk for (pk,) in h.db.rows("SELECT id FROM runs_run WHERE state = 'leased'")} == set(
        first
    )
    # A new API server starts meanwhile: it will replace this one, a restart.
    switch_api = h.services.replace_api()
    wait_for(lambda: all_in(h.db, first, "succeeded"), 20, "the in-flight runs to finish")

    # New API server process, new worker process: the pause is in the database, so it holds.
    worker.kill()
    switch_api()
    h.worker("pause-2", "pausable", concurrency=2)
    wait_for(
        lambda: (
            h.db.scalar("SELECT last_worker_id FROM jobs_queue WHERE name = 'pausable' AND paused")
            == "pause-2"
        ),
        30,
        "the new worker to ask the paused queue for work",
    )
    time.sleep(0.5)
    assert all(
        (run["state"], run["attempt"]) == ("scheduled", 0) for run in runs(h.db, rest).values()
    )

    with h.http() as http:
        assert http.post("/api/v1/queues/pausable/resume").status_code == 200
    wait_for(lambda: all_in(h.db, rest, "succeeded"), 20, "the rest after the resume")
    h.check()


def test_a_run_is_not_leased_to_a_worker_that_died_while_long_polling(harness):
    h = harness
    definition = h.definition("faults.work", "ghost")
    ghost = h.worker("ghost", "ghost", wait=10)
    # Its first long poll (10 s, nothing to lease yet) has reached the server: the server notes
    # which worker asked for the queue as the request comes in.
    wait_for(
        lambda: (
            h.db.scalar("SELECT last_worker_id FROM jobs_queue WHERE name = 'ghost'") == "ghost"
        ),
        30,
        "the worker's long poll",
    )
    ghost.kill()
    (pk,) = h.add_runs(definition, [{}])
    time.sleep(2)
    run = runs(h.db, [pk])[pk]
    # Nobody alive asked for it: it must still be waiting, not leased to the dead worker
    # (whose lease would hold it for a lease period, and cost it an attempt).
    assert (run["state"], run["attempt"]) == ("scheduled", 0), run


def transactions(db) -> int:
    """Transactions committed or rolled back in this database so far (cumulative statistics)."""
    db.scalar("SELECT pg_stat_clear_snapshot()")
    return db.scalar(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
    )


def test_a_long_poll_on_a_paused_queue_waits_instead_of_polling(harness):
    """Workers keep polling a paused queue; each long poll must wait (NOTIFY or its re-check),
    not re-claim the held runs in a loop. (It re-claimed every 10 ms until 08736df.)"""
    h = harness
    definition = h.definition("faults.work", "paused-poll")
    h.add_runs(definition, [{}] * 3)
    with h.http() as http:
        assert http.post("/api/v1/queues/paused-poll/pause").status_code == 200
        body = {"queues": ["paused-poll"], "max": 1, "workerId": "poller", "waitSeconds": 2}
        http.post("/api/v1/leases", json={**body, "waitSeconds": 0})  # the LISTEN is up
        with h.services.reaper_paused():
            h.sampler.stop()
            time.sleep(1.5)  # statistics are flushed at most once a second
            before = transactions(h.db)
            assert http.post("/api/v1/leases", json=body).json() == {"leases": []}
            time.sleep(1.5)
            spent = transactions(h.db) - before
    # Waiting for a NOTIFY (or the 5 s re-check) costs a handful of transactions, not hundreds.
    assert spent < 60, f"{spent} transactions during one 2 s long poll"
