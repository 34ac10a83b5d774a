"""The store on shards with servers of their own: results, heartbeats and the reaper go to
each run's database, one transaction per database, and a database that is down answers 503
for its runs alone."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from functools import partial

import httpx
import pytest
from django.db import connections, transaction

from apps.audit.record import Actor
from apps.jobs import services
from apps.jobs.models import JobDefinition, Queue
from apps.runs import leasing, shards, store
from apps.runs.ids import parse_run_id, public_run_id
from apps.runs.models import Attempt, Run
from tests.conftest import (
    Drain,
    Layout,
    assert_invariants_everywhere,
    claim,
    db_now,
    stored_run,
)
from tests.runs.test_claim_concurrency import run_in_threads

pytestmark = [
    pytest.mark.slow,
    pytest.mark.physical,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]


def test_a_batch_of_results_commits_on_each_database_of_its_runs(layout, team_a):
    first, second = layout.aliases
    on_first = layout.leased_runs(layout.job_on(first, team_a, "alpha"), 2)
    on_second = layout.leased_runs(layout.job_on(second, team_a, "beta"), 2)
    items = [
        (on_first[0].pk, on_first[0].fencing_token, {"ok": 1}),
        (on_second[0].pk, on_second[0].fencing_token, None),
        (on_first[1].pk, on_first[1].fencing_token - 1, None),  # stale
        (on_second[1].pk, on_second[1].fencing_token, None),
    ]

    outcomes = store.complete(items, team_ids=[team_a.pk])

    assert [(o.id, o.status) for o in outcomes] == [
        (on_first[0].pk, 200), (on_second[0].pk, 200), (on_first[1].pk, 409),
        (on_second[1].pk, 200),
    ]  # fmt: skip
    for alias, runs in ((first, on_first), (second, on_second)):
        with shards.using(alias):
            states = dict(
                Run.objects.filter(pk__in=[r.pk for r in runs]).values_list("pk", "state")
            )
        assert shards.alias_of_run(runs[0].pk) == alias
        expected = {on_first[0].pk: "succeeded", on_first[1].pk: "leased"} if alias == first else {
            r.pk: "succeeded" for r in on_second
        }  # fmt: skip
        assert states == expected
    # Nothing of either database's runs was written to another database.
    for alias in shards.databases():
        if alias not in (first, second):
            assert not Run.objects.using(alias).exists()


def test_another_teams_run_is_404_on_whichever_database_it_lives(layout, team_a, team_b):
    first, second = layout.aliases
    theirs = layout.leased_runs(layout.job_on(second, team_b, "theirs"), 1)[0]
    mine = layout.leased_runs(layout.job_on(first, team_a, "mine"), 1)[0]

    outcomes = store.heartbeat(
        [(theirs.pk, theirs.fencing_token), (mine.pk, mine.fencing_token)], team_ids=[team_a.pk]
    )

    assert [o.status for o in outcomes] == [404, 200]
    assert outcomes[0].denied_team_id == team_b.pk


def test_a_database_that_is_down_answers_503_for_its_runs_and_the_others_commit(layout, team_a):
    first, second = layout.aliases
    alive = layout.leased_runs(layout.job_on(first, team_a, "alive"), 1)[0]
    doomed = layout.leased_runs(layout.job_on(second, team_a, "doomed"), 1)[0]
    with layout.down(1):
        outcomes = store.complete(
            [(doomed.pk, doomed.fencing_token, None), (alive.pk, alive.fencing_token, None)],
            team_ids=[team_a.pk],
        )
    held = shards.shards_on(second)
    assert [o.status for o in outcomes] == [503, 200]
    assert f"shards {held[0]}-{held[-1]} are unavailable" in outcomes[0].detail
    with shards.using(first):
        assert Run.objects.get(pk=alive.pk).state == "succeeded"

    # Back up: the run completes with its token, as if nothing had happened.
    again = store.complete([(doomed.pk, doomed.fencing_token, None)], team_ids=[team_a.pk])
    assert [o.status for o in again] == [200]


def test_the_reaper_reaps_each_database_of_the_shards_it_owns(layout, team_a):
    first, second = layout.aliases
    runs = {
        alias: layout.leased_runs(layout.job_on(alias, team_a, f"reap{n}"), 2)
        for n, alias in enumerate(layout.aliases)
    }
    for alias in layout.aliases:
        with connections[alias].cursor() as cursor:
            cursor.execute("UPDATE runs_run SET lease_expires_at = now() - interval '1 second'")

    only_first = store.reap(shards=shards.shards_on(first))
    assert sorted(r.id for r in only_first) == sorted(r.pk for r in runs[first])
    everything_else = store.reap()
    assert sorted(r.id for r in everything_else) == sorted(r.pk for r in runs[second])
    assert {r.outcome for r in only_first + everything_else} == {"lease_expired"}


def test_the_api_answers_503_naming_the_shards_of_a_database_that_is_down(layout, team_a, api_a):
    first, second = layout.aliases
    alive = layout.leased_runs(layout.job_on(first, team_a, "api-alive"), 1)[0]
    doomed = layout.leased_runs(layout.job_on(second, team_a, "api-doomed"), 1)[0]
    with layout.down(1):
        single = api_a.post(
            f"/api/v1/runs/{doomed.run_id}/complete", {"fencingToken": doomed.fencing_token}
        )
        batch = api_a.post(
            "/api/v1/heartbeats",
            {
                "leases": [
                    {"runId": doomed.run_id, "fencingToken": doomed.fencing_token},
                    {"runId": alive.run_id, "fencingToken": alive.fencing_token},
                ]
            },
        )
    held = shards.shards_on(second)
    assert single.status_code == 503, single.text
    assert single.headers["content-type"] == "application/problem+json"
    assert single.json()["type"].endswith("/shard-unavailable")
    assert f"shards {held[0]}-{held[-1]} are unavailable" in single.json()["detail"]
    assert [item["status"] for item in batch.json()["leases"]] == [503, 200]
    again = api_a.post(
        f"/api/v1/runs/{doomed.run_id}/complete", {"fencingToken": doomed.fencing_token}
    )
    assert again.status_code == 200, again.text


def _jobs_everywhere(layout: Layout, team, prefix: str) -> dict[str, JobDefinition]:
    return {alias: layout.job_on(alias, team, prefix) for alias in shards.databases()}


def _enqueue(api, jobs: dict[str, JobDefinition], per_job: int, tag: str) -> list[dict]:
    items = [
        {"job": job.name, "idempotencyKey": f"{tag}-{job.name}-{n}"}
        for job in jobs.values()
        for n in range(per_job)
    ]
    answer = api.post("/api/v1/runs", {"runs": items})
    assert answer.status_code == 200, answer.text
    return answer.json()["runs"]


def test_runs_enqueued_leased_and_completed_over_the_api_stay_on_their_shards(
    layout, team_a, api_a
):
    jobs = _jobs_everywhere(layout, team_a, "e2e")
    assert len(jobs) == len(shards.databases()) >= 2
    created = _enqueue(api_a, jobs, 3, "a")
    assert [item["status"] for item in created] == [201] * 3 * len(jobs)
    for alias, job in jobs.items():
        stored = Run.objects.using(alias).filter(definition_id=job.pk)
        assert stored.count() == 3
        assert {shards.alias_of_run(run.pk) for run in stored} == {alias}

    leased = api_a.post(
        "/api/v1/leases", {"queues": ["q"], "max": 20, "workerId": "w-1", "leaseSeconds": 60}
    ).json()["leases"]
    assert sorted(lease["runId"] for lease in leased) == sorted(
        item["run"]["runId"] for item in created
    )
    results = api_a.post(
        "/api/v1/results",
        {
            "results": [
                {"runId": lease["runId"], "fencingToken": lease["fencingToken"],
                 "outcome": "succeeded"}
                for lease in leased
            ]
        },
    ).json()["results"]  # fmt: skip
    assert [item["status"] for item in results] == [200] * 3 * len(jobs)
    for alias in jobs:
        states = set(Run.objects.using(alias).values_list("state", flat=True))
        assert states == {"succeeded"}


def test_with_one_shard_database_down_the_others_enqueue_and_lease(layout, team_a, api_a):
    jobs = _jobs_everywhere(layout, team_a, "down")
    second = layout.aliases[1]
    with layout.down(1):
        created = _enqueue(api_a, jobs, 2, "b")
        leased = api_a.post(
            "/api/v1/leases", {"queues": ["q"], "max": 20, "workerId": "w-2", "waitSeconds": 0}
        )
    held = shards.shards_on(second)
    by_job = {}
    for item, job in zip(created, [j for j in jobs.values() for _ in range(2)], strict=True):
        by_job.setdefault(job.name, []).append(item)
    for alias, job in jobs.items():
        statuses = [item["status"] for item in by_job[job.name]]
        if alias == second:
            assert statuses == [503, 503]
            assert by_job[job.name][0]["type"].endswith("/shard-unavailable")
            assert f"shards {held[0]}-{held[-1]} are unavailable" in by_job[job.name][0]["detail"]
        else:
            assert statuses == [201, 201]
    assert leased.status_code == 200, leased.text
    assert len(leased.json()["leases"]) == 2 * (len(jobs) - 1)  # the live databases' runs
    assert not Run.objects.using(second).exists()


def test_a_long_poll_wakes_for_a_run_enqueued_on_any_shard_database(layout, team_a, api_a):
    jobs = _jobs_everywhere(layout, team_a, "poll")
    last = jobs[layout.aliases[-1]]
    got: dict = {}

    def poll() -> None:
        got["answer"] = api_a.post(
            "/api/v1/leases",
            {"queues": ["q"], "max": 5, "workerId": "w-3", "waitSeconds": 20},
        )

    waiter = threading.Thread(target=poll)
    started = time.monotonic()
    waiter.start()
    time.sleep(1.0)  # the poll is waiting
    _enqueue(api_a, {"only": last}, 1, "c")
    waiter.join(25)
    took = time.monotonic() - started
    leases = got["answer"].json()["leases"]
    assert [lease["job"] for lease in leases] == [last.name]
    assert took < 1.0 + 1.9  # woken by the NOTIFY, not by the two-second re-check or the end


def test_readiness_names_a_shard_database_that_is_down_and_stays_serving(
    layout, live_server, team_a
):
    def ready() -> httpx.Response:
        return httpx.get(f"{live_server.url}/readyz", timeout=30)

    jobs = {alias: layout.job_on(alias, team_a, "ready") for alias in shards.databases()}
    for n, job in enumerate(jobs.values()):
        layout.new_runs(job, n + 1, "r")
    spans = [shards.shards_on(alias) for alias in shards.databases()]
    expected = [
        {"shards": f"{s[0]}-{s[-1]}", "reachable": True, "depth": n + 1, "lagSeconds": 0.0}
        for n, s in enumerate(spans)
    ]
    assert ready().json()["shardDatabases"] == expected
    with layout.down(1):
        down = ready()
    assert down.status_code == 200
    assert down.json()["status"] == "degraded"
    second = shards.databases().index(layout.aliases[1])
    reachable = [d["reachable"] for d in down.json()["shardDatabases"]]
    assert reachable == [n != second for n in range(len(expected))]
    assert down.json()["shardDatabases"][second]["shards"] == expected[second]["shards"]
    assert ready().json()["status"] == "ok"


def test_eight_claimers_across_the_shard_databases_lease_every_run_exactly_once(layout, team_a):
    per_database = 300
    for alias in shards.databases():
        definition = layout.job_on(alias, team_a, "spread")
        with shards.using(alias):
            store.insert_runs(
                [
                    store.NewRun(definition.pk, "api", definition.created_at,
                                 definition.created_at, f"s{n}")
                    for n in range(per_database)
                ]
            )  # fmt: skip
    request = partial(
        leasing.LeaseRequest, team_id=team_a.pk, team_ids=[team_a.pk], queues=["q"], jobs=None,
        max_runs=25, lease_seconds=60, wait_seconds=0,
    )  # fmt: skip

    def claimer(index: int) -> list[int]:
        mine: list[int] = []
        try:
            while True:
                got = leasing.claim_or_wait(
                    request(worker_id=f"w-{index}"), lambda leases: [lease.id for lease in leases]
                )
                if not got:
                    return mine
                mine += got
        finally:
            connections.close_all()  # this thread's session on every database

    claimed = run_in_threads(8, claimer)

    everything = [run_id for ids in claimed for run_id in ids]
    assert len(everything) == len(set(everything)) == per_database * len(shards.databases())
    assert sum(1 for ids in claimed if ids) > 1  # the claimers shared the work
    for alias in shards.databases():
        leased = Run.objects.using(alias).filter(state="leased")
        assert leased.count() == per_database
        assert Attempt.objects.using(alias).count() == per_database
        assert {shards.alias_of_run(pk) for pk in leased.values_list("pk", flat=True)} == {alias}


def test_a_run_is_read_cancelled_and_retried_by_id_on_its_shard_database(layout, team_a, api_a):
    from apps.audit.models import AuditEvent

    jobs = _jobs_everywhere(layout, team_a, "byid")
    created = _enqueue(api_a, {"last": jobs[layout.aliases[-1]]}, 2, "d")
    first, second = (item["run"]["runId"] for item in created)

    shown = api_a.get(f"/api/v1/runs/{first}")
    assert shown.status_code == 200, shown.text
    assert shown.json()["runId"] == first and shown.json()["attempts"] == []
    cancelled = api_a.post(f"/api/v1/runs/{first}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["state"] == "cancelled"
    assert api_a.post(f"/api/v1/runs/{first}/cancel").status_code == 409
    assert stored_run(parse_run_id(first)).state == "cancelled"
    assert AuditEvent.objects.filter(action="run.cancel", target=first).count() == 1

    with layout.down(len(layout.servers) - 1):
        down = api_a.get(f"/api/v1/runs/{second}")
    assert down.status_code == 503 and down.json()["type"].endswith("/shard-unavailable")


def test_the_run_list_merges_every_shard_database_page_by_page(layout, team_a, api_a):
    jobs = _jobs_everywhere(layout, team_a, "list")
    created = _enqueue(api_a, jobs, 4, "e")
    made = {item["run"]["runId"] for item in created}

    seen: list[str] = []
    url = "/api/v1/runs?limit=5"
    while url:
        page = api_a.get(url).json()
        assert "unavailableShards" not in page
        seen += [run["runId"] for run in page["results"]]
        url = page["next"]
    assert len(seen) == len(set(seen)) and set(seen) == made
    ids = [parse_run_id(run_id) for run_id in seen]
    assert ids == sorted(ids, reverse=True)  # newest first by id, across databases

    one_job = jobs[layout.aliases[0]].name
    only = api_a.get(f"/api/v1/runs?job={one_job}").json()["results"]
    assert {run["job"] for run in only} == {one_job} and len(only) == 4

    with layout.down(len(layout.servers) - 1):
        partial_page = api_a.get("/api/v1/runs?limit=100").json()
    dead = shards.span(layout.aliases[-1])
    assert partial_page["unavailableShards"] == [dead]
    assert len(partial_page["results"]) == 4 * (len(jobs) - 1)


def test_killing_one_shard_server_while_eight_workers_drain_confines_the_loss(layout, team_a):
    """SIGKILL one shard server mid-drain: the other databases' runs all succeed while it is
    down; after its restart its runs resume (expired leases reaped) and, on every server, no
    run is lost or succeeded twice."""
    per_database = 150
    made = {
        alias: layout.new_runs(layout.job_on(alias, team_a, "kill"), per_database, "k")
        for alias in shards.databases()
    }
    victim = layout.aliases[1]
    others = [alias for alias in shards.databases() if alias != victim]
    with Drain(team_a, 8, lease_seconds=2, reaper=True) as drain:
        deadline = time.monotonic() + 60
        while drain.done(made[victim]) < per_database // 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        with layout.down(1):
            while time.monotonic() < deadline and any(
                drain.done(made[alias]) < per_database for alias in others
            ):
                time.sleep(0.05)
            # Every other database's runs succeeded while the victim was down.
            assert [drain.done(made[alias]) for alias in others] == [per_database] * len(others)
            assert drain.done(made[victim]) < per_database
        while time.monotonic() < deadline + 60 and drain.done(made[victim]) < per_database:
            time.sleep(0.05)

    assert all(count == 1 for count in drain.succeeded.values())  # none answered 200 twice
    for alias, ids in made.items():
        states = dict(Run.objects.using(alias).filter(pk__in=ids).values_list("pk", "state"))
        assert set(states) == set(ids)  # none lost
        assert set(states.values()) == {"succeeded"}, alias
    assert_invariants_everywhere()


def test_a_paused_queue_holds_at_once_in_the_process_that_paused_it_and_within_a_second_elsewhere(
    layout, team_a
):
    """With shards on databases of their own, a claim knows the paused queues from a copy of
    the control database's, read once a second: a pause made through this process holds for its
    next claim; one made by another process (here: straight in the control database) within
    CONTROL_STATE_SECONDS."""
    job = layout.job_on(layout.aliases[0], team_a, "held")
    layout.new_runs(job, 4, "h")
    oscar = Actor(label="oscar", source="dashboard")

    def one() -> list[store.Lease]:
        return claim(queues=[job.queue], max_runs=1, worker_id="w", team_ids=[team_a.pk])

    assert len(one()) == 1  # the copy is read
    services.set_queue_paused(team_a, job.queue, True, oscar)
    assert one() == []
    services.set_queue_paused(team_a, job.queue, False, oscar)
    assert len(one()) == 1
    Queue.objects.filter(team=team_a, name=job.queue).update(paused=True)
    time.sleep(leasing.CONTROL_STATE_SECONDS + 0.1)
    assert one() == []
    Queue.objects.filter(team=team_a, name=job.queue).update(paused=False)
    time.sleep(leasing.CONTROL_STATE_SECONDS + 0.1)
    assert len(one()) == 1


def test_a_claim_on_a_shard_database_of_its_own_bounds_its_lock_waits(layout, team_a):
    """The candidates statement sets the transaction's lock timeout (no round trip of its own):
    the rest of the claim gives a database up rather than wait on a lock across databases."""
    first = layout.aliases[0]
    job = layout.job_on(first, team_a, "bounded")
    layout.new_runs(job, 2, "b")
    lanes = store.Lanes([team_a.pk], [])
    with shards.using(first), store.atomic(), store.server_cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        before = cursor.fetchone()[0]
        leased = store.claim(
            queues=[job.queue], max_runs=2, worker_id="w", lease_seconds=60,
            team_ids=[team_a.pk], lanes=lanes,
        )  # fmt: skip
        cursor.execute("SHOW lock_timeout")
        assert (before, cursor.fetchone()[0], len(leased)) == ("0", "200ms", 2)


def test_a_result_sent_while_its_shard_server_is_down_is_taken_once_it_is_back(
    layout, team_a, live_server, token_a, caplog
):
    """The SDK's report of a run on a server that is down is answered 503 for that item; the
    SDK sends it again, with pauses, and the restarted server takes it: the work is not lost
    to a lease expiry (and done again) for a restart."""
    from cronlease_client.reporting import LeasedRun, Report, send_results
    from cronlease_client.transport import Transport

    job = layout.job_on(layout.aliases[1], team_a, "back")
    (run,) = layout.leased_runs(job, 1)
    leased = LeasedRun(public_run_id(run.pk), job.name, 1, run.fencing_token)
    http = Transport(live_server.url, token_a)
    states: dict = {}
    caplog.set_level("INFO", logger="cronlease_client")
    with layout.down(1):
        sending = threading.Thread(
            target=lambda: states.update(
                send_results(http, [(leased, Report("succeeded", {"after": "restart"}))])
            )
        )
        sending.start()
        time.sleep(0.3)  # its first answer is a 503: the server is down
    sending.join(30)
    http.close()
    assert states == {leased.run_id: "succeeded"}
    assert "result not taken yet" in caplog.text  # answered 503 first, then sent again
    stored = Run.objects.using(layout.aliases[1]).get(pk=run.pk)
    assert (stored.state, stored.result) == ("succeeded", {"after": "restart"})


def test_queues_and_alerts_read_every_shard_database_and_name_one_that_is_down(
    layout, team_a, api_a
):
    """A queue is listed for a definition on any database, even with nothing waiting; with a
    database down, the queue list and the alerts still answer, naming its shards."""
    jobs = _jobs_everywhere(layout, team_a, "queues")
    for alias, job in jobs.items():
        JobDefinition.objects.using(alias).filter(pk=job.pk).update(queue=f"q-{alias}")
    listed = api_a.get("/api/v1/queues")
    assert listed.status_code == 200, listed.text
    assert [q["name"] for q in listed.json()["results"]] == sorted(f"q-{a}" for a in jobs)
    assert "unavailableShards" not in listed.json()
    assert "unavailableShards" not in api_a.get("/api/v1/alerts").json()

    dead = shards.span(layout.aliases[-1])
    with layout.down(len(layout.servers) - 1):
        partial = api_a.get("/api/v1/queues")
        alerts = api_a.get("/api/v1/alerts")
    assert partial.status_code == 200, partial.text
    assert partial.json()["unavailableShards"] == [dead]
    assert [q["name"] for q in partial.json()["results"]] == sorted(
        f"q-{a}" for a in jobs if a != layout.aliases[-1]
    )
    assert alerts.status_code == 200, alerts.text
    assert alerts.json() == {"results": [], "total": 0, "next": None, "unavailableShards": [dead]}


def test_a_scheduler_with_one_shard_database_down_materialises_the_others(layout, team_a):
    from apps.scheduler.daemon import Scheduler

    # The database holding the lowest shards is the one down: a tick that stopped at its first
    # failure would never reach the others.
    victim = min(layout.aliases, key=lambda alias: shards.shards_on(alias)[0])
    alive = next(alias for alias in layout.aliases if alias != victim)
    jobs = {
        alias: layout.job_on(alias, team_a, f"tick{n}") for n, alias in enumerate(layout.aliases)
    }
    scheduler = Scheduler(node_id="test-node")
    scheduler.tick()  # takes every shard; nothing is due yet
    layout.due_every_minute(jobs.values())
    with layout.down(layout.aliases.index(victim)):
        scheduler.tick()
        with shards.using(alive):
            assert Run.objects.filter(definition_id=jobs[alive].pk).exists()
    scheduler.tick()  # back: its shards catch up
    with shards.using(victim):
        assert Run.objects.filter(definition_id=jobs[victim].pk).exists()


def test_readyz_is_503_naming_a_shard_database_left_unmigrated(layout, live_server):
    def ready() -> httpx.Response:
        return httpx.get(f"{live_server.url}/readyz", timeout=30)

    behind = layout.aliases[1]
    held = shards.span(behind)
    with connections[behind].cursor() as cursor:
        cursor.execute(
            "DELETE FROM django_migrations WHERE app = 'runs' AND name = ("
            "SELECT max(name) FROM django_migrations WHERE app = 'runs') RETURNING name"
        )
        (latest,) = cursor.fetchone()
        try:
            pending = ready()
            # Its tables missing altogether (a database never migrated): still an answer.
            cursor.execute("ALTER TABLE runs_run RENAME TO runs_run_away")
            try:
                bare = ready()
                metrics = httpx.get(f"{live_server.url}/metrics", timeout=30)
            finally:
                cursor.execute("ALTER TABLE runs_run_away RENAME TO runs_run")
        finally:
            cursor.execute(
                "INSERT INTO django_migrations (app, name, applied) VALUES ('runs', %s, now())",
                [latest],
            )
    for answer in (pending, bare):
        assert answer.status_code == 503, answer.text
        assert answer.json()["status"] == "unavailable"
        assert f"shards {held} has migrations pending" in answer.json()["detail"]
    assert metrics.status_code == 200
    assert ready().json()["status"] == "ok"


def test_two_batches_naming_the_same_large_payloads_over_two_databases_do_not_deadlock(
    layout: Layout, team_a, payload_folder
):
    """Each database's insert held its own runs' blobs: batch A held X (first database) and
    then waited for Y, which batch B (Y on the first database, X on the second) held, while B
    waited for X. PostgreSQL failed one of them, and the request answered 500."""
    from apps.jobs.enqueue import Wanted, enqueue_many

    first, second = layout.aliases
    here, there = layout.job_on(first, team_a, "here"), layout.job_on(second, team_a, "there")
    x, y = {"x": "x" * 5000}, {"y": "y" * 5000}  # each kept in storage
    batches = [
        [Wanted(here.name, "a1", payload=x), Wanted(there.name, "a2", payload=y)],
        [Wanted(here.name, "b1", payload=y), Wanted(there.name, "b2", payload=x)],
    ]
    actor = Actor.system("test")
    # Both batches wait on the first database's insert (its definition's row held: the insert's
    # foreign-key check), each having held the blob of its run there.
    with connections[first].cursor() as holder, transaction.atomic(using=first):
        holder.execute("SELECT 1 FROM jobs_jobdefinition WHERE id = %s FOR UPDATE", [here.pk])
        answers: list = []
        threads = [
            threading.Thread(
                target=lambda batch=batch: answers.append(
                    _enqueue_closing(enqueue_many, [team_a.pk], batch, actor)
                )
            )
            for batch in batches
        ]
        for thread in threads:
            thread.start()
            time.sleep(0.5)
    for thread in threads:
        thread.join(30)
    assert len(answers) == 2
    for answer in answers:
        assert not isinstance(answer, Exception), answer
        assert [item.status for item in answer.answers] == [201, 201]
    for alias, definition in ((first, here), (second, there)):
        assert Run.objects.using(alias).filter(definition_id=definition.pk).count() == 2
    assert len(list(payload_folder.rglob("*.json"))) == 2


def _enqueue_closing(enqueue, *args):
    try:
        return enqueue(*args)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        return exc
    finally:
        connections.close_all()


def test_a_queue_resumed_with_one_shard_database_down_resumes_everywhere_without_backfill(
    layout, team_a
):
    """The resume restarts the queue's schedules on every database first: with one down it was
    refused (503) until that one returned, and the queue's runs on every other database stayed
    unleased. It resumes now; the down database's schedules restart from the resume's time when
    the scheduler next meets them, the pause not back-filled there either."""
    from apps.scheduler.daemon import Scheduler

    victim, alive = layout.aliases[1], layout.aliases[0]
    jobs = {
        alias: layout.job_on(alias, team_a, f"resume{n}") for n, alias in enumerate(layout.aliases)
    }
    oscar = Actor(label="oscar", source="dashboard")
    services.set_queue_paused(team_a, "q", True, oscar)
    # Paused for ten minutes: every-minute schedules whose fire times ten minutes ago are due.
    for job in jobs.values():
        with shards.using(shards.alias_of_shard(job.shard)):
            JobDefinition.objects.filter(pk=job.pk).update(
                schedule={"cron": "* * * * *", "jitterSeconds": 0, "missedRunPolicy": "run_all"},
                next_due_at=db_now().replace(second=0, microsecond=0) - timedelta(minutes=10),
                armed_at=db_now() - timedelta(minutes=20),
            )
    queued = layout.new_runs(jobs[alive], 1, "waiting")
    with layout.down(layout.aliases.index(victim)):
        queue, changed = services.set_queue_paused(team_a, "q", False, oscar)
        assert changed and not queue.paused and queue.rearm_from is not None
        # The other database's runs of the queue are leased again at once.
        leased = claim(queues=["q"], max_runs=5, worker_id="w", team_ids=[team_a.pk])
        assert [lease.id for lease in leased] == queued
    resumed_at = Queue.objects.get(team=team_a, name="q").rearm_from
    Scheduler(node_id="test-node").tick()
    for alias, job in jobs.items():
        with shards.using(alias):
            made = Run.objects.filter(definition_id=job.pk).exclude(
                idempotency_key__startswith="waiting"
            )
            definition = JobDefinition.objects.get(pk=job.pk)
            # No run of a fire time before the resume: the ten paused minutes stay unfilled.
            assert all(run.due_at > resumed_at for run in made), (alias, [r.due_at for r in made])
            assert definition.next_due_at > resumed_at and definition.armed_at >= resumed_at
    # A pause, then a resume that reaches every database, leaves nothing to restart.
    services.set_queue_paused(team_a, "q", True, oscar)
    services.set_queue_paused(team_a, "q", False, oscar)
    assert Queue.objects.get(team=team_a, name="q").rearm_from is None
