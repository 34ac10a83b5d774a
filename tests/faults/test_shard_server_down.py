"""A shard server killed under the real API server (uvicorn, pooled connections): requests for
its shards are refused at once, not after the pool's 10 s timeout, the other databases go on
serving, and the API server takes the server back within seconds of its restart, not after the
pool's minute of back-off (scheduler_site/postgresql/base.py, `Breaker`)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from django.db import OperationalError

from apps.runs import shards
from apps.runs.ids import public_run_id

pytestmark = [
    pytest.mark.slow,
    pytest.mark.physical,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]

# Down long enough for the pool's own reconnection attempts to back off past it (1, 2, 4, 8 s
# after the first failure): a pool left to itself would come back about 15 s after the server.
OUTAGE_SECONDS = 16
# What "at once" and "within seconds" allow on a loaded two-core machine; the pool's timeout,
# which the breaker cuts short, is 10 s.
PROMPT_SECONDS = 5


def timed(http: httpx.Client, method: str, path: str, **kwargs) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer = http.request(method, path, **kwargs)
    return answer, time.monotonic() - started


def test_a_killed_shard_server_is_refused_at_once_and_taken_back_within_seconds(harness, layout):
    victim, other = layout.aliases[1], layout.aliases[0]
    runs = {
        alias: layout.new_runs(layout.job_on(alias, harness.team, f"breaker-{alias}"), 3, "b")
        for alias in (victim, other)
    }
    path = f"/api/v1/runs/{public_run_id(runs[victim][0])}"
    lease = {"queues": ["q"], "max": 1, "workerId": "w", "waitSeconds": 0}
    held = shards.shards_on(victim)
    with harness.http() as http:
        assert http.get(path).status_code == 200  # the pool holds connections to the victim

        with layout.down(1):
            refused = [timed(http, "GET", path) for _ in range(5)]
            leased, lease_took = timed(http, "POST", "/api/v1/leases", json=lease)
            # Lists across databases answer without the victim's rows, and say so.
            partial = {name: http.get(f"/api/v1/{name}") for name in ("queues", "workers")}
            time.sleep(OUTAGE_SECONDS)
            late, late_took = timed(http, "GET", path)
        back_at = time.monotonic()
        while (back := http.get(path)).status_code != 200 and time.monotonic() - back_at < 60:
            time.sleep(0.1)
        back_after = time.monotonic() - back_at
    harness.db.reconnect()  # the probes' session to the victim died with it

    for answer, took in [*refused, (late, late_took)]:
        assert answer.status_code == 503, answer.text
        assert answer.json()["type"].endswith("/shard-unavailable")
        assert f"shards {held[0]}-{held[-1]} are unavailable" in answer.json()["detail"]
        assert took < PROMPT_SECONDS, [round(t, 2) for _, t in refused]
    # The other database leases while the victim is down, as promptly.
    assert leased.status_code == 200 and lease_took < PROMPT_SECONDS, (leased.text, lease_took)
    assert [item["runId"] for item in leased.json()["leases"]] == [public_run_id(runs[other][0])]
    assert back.status_code == 200 and back_after < PROMPT_SECONDS, back_after
    for name, answer in partial.items():
        assert answer.status_code == 200, (name, answer.text)
        assert answer.json().get("unavailableShards") == [shards.span(victim)], (name, answer.text)


# A statement waits STALL_SECONDS before its server is tried, and the try waits up to
# TRY_TIMEOUT_SECONDS (scheduler_site/postgresql/stalls.py): 5 s, and a loaded machine's slack.
CUT_SECONDS = 10


def test_a_shard_server_that_stops_answering_holds_back_its_own_shards_only(harness, layout):
    """The victim's processes stopped (SIGSTOP), its sockets still open: a statement sent there
    waited for as long as it stayed stopped, and so did every lease request (each claims on
    every database), /readyz and /metrics. It is cut once the server does not answer a try."""
    victim, other = layout.aliases[1], layout.aliases[0]
    runs = {
        alias: layout.new_runs(layout.job_on(alias, harness.team, f"frozen-{alias}"), 3, "f")
        for alias in (victim, other)
    }
    path = f"/api/v1/runs/{public_run_id(runs[victim][0])}"
    lease = {"queues": ["q"], "max": 1, "workerId": "w", "waitSeconds": 0}
    with harness.http() as http:
        assert http.get(path).status_code == 200  # the pool holds connections to the victim
        with layout.servers[1].frozen():
            stalled, stalled_took = timed(http, "GET", path)
            leased, lease_took = timed(http, "POST", "/api/v1/leases", json=lease)
            ready, ready_took = timed(http, "GET", "/readyz")
        back_at = time.monotonic()
        while (back := http.get(path)).status_code != 200 and time.monotonic() - back_at < 60:
            time.sleep(0.1)
        back_after = time.monotonic() - back_at

    assert stalled.status_code == 503 and stalled_took < CUT_SECONDS, (stalled.text, stalled_took)
    assert stalled.json()["type"].endswith("/shard-unavailable"), stalled.text
    assert leased.status_code == 200 and lease_took < PROMPT_SECONDS, (leased.text, lease_took)
    assert [item["runId"] for item in leased.json()["leases"]] == [public_run_id(runs[other][0])]
    assert ready_took < PROMPT_SECONDS and ready.json()["status"] == "degraded", ready.text
    assert back.status_code == 200 and back_after < PROMPT_SECONDS, back_after


def test_a_daemons_health_check_and_new_connection_to_a_stopped_server_give_up(layout):
    """A scheduler's connection is checked by Django before use (`is_usable`, a SELECT 1 past
    the execute wrappers, so not watched) and made again at least once a minute (libpq's
    connect waited without a limit): on a stopped server either held the scheduler, and its
    leases on every shard lapsed."""
    from django.db import connections

    alias = layout.aliases[1]
    connected, frozen = threading.Event(), threading.Event()
    took: dict[str, object] = {}

    def daemon() -> None:  # a thread's own connection, as a daemon's
        victim = connections[alias]
        try:
            victim.ensure_connection()
            connected.set()
            frozen.wait(30)
            started = time.monotonic()
            took["usable"] = victim.is_usable()
            took["check"] = time.monotonic() - started
            victim.close()
            started = time.monotonic()
            try:
                victim.ensure_connection()
            except OperationalError:
                took["connect"] = time.monotonic() - started
        finally:
            victim.close()

    thread = threading.Thread(target=daemon)
    thread.start()
    assert connected.wait(30)
    with layout.servers[1].frozen():
        frozen.set()
        thread.join(2 * CUT_SECONDS + 5)  # held for good before: bounded here, then let go
        held = thread.is_alive()
    thread.join(30)
    assert not held, took
    assert took["usable"] is False and took["check"] < CUT_SECONDS, took
    assert took["connect"] < CUT_SECONDS, took
