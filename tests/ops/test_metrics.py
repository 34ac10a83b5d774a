"""/metrics after a scripted workload: counters and histograms equal what was done."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from apps.runs import store
from tests.conftest import add_ready_runs, expire_lease, make_definition, other_session

pytestmark = pytest.mark.django_db(transaction=True)


def scrape(api) -> dict[tuple[str, tuple], float]:
    answer = api.get("/metrics")
    assert answer.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_follow_the_workload(api_a, team_a):
    definition = make_definition(
        team_a, "m.job", queue="mq", priority="critical", retry_max_attempts=1
    )
    add_ready_runs(definition, 6)
    before = scrape(api_a)
    leases = api_a.lease(["mq"], 6)
    assert len(leases) == 6
    a, b, c, d, e, f = leases
    api_a.post(f"/api/v1/runs/{a['runId']}/complete", {"fencingToken": a["fencingToken"]})
    api_a.post(f"/api/v1/runs/{b['runId']}/complete", {"fencingToken": b["fencingToken"]})
    api_a.post(
        f"/api/v1/runs/{c['runId']}/fail", {"fencingToken": c["fencingToken"], "retryable": False}
    )
    api_a.post(f"/api/v1/runs/{d['runId']}/heartbeat", {"fencingToken": d["fencingToken"] + 10_000})
    api_a.post(f"/api/v1/runs/{a['runId']}/complete", {"fencingToken": a["fencingToken"]})
    from apps.runs.ids import parse_run_id

    expire_lease(parse_run_id(e["runId"]))
    store.reap()
    after = scrape(api_a)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("scheduler_runs_started_total", queue="mq", priority="critical") == 6
    assert (
        delta(
            "scheduler_due_to_start_seconds_count", queue="mq", priority="critical", team="team-a"
        )
        == 6
    )
    assert delta("scheduler_runs_succeeded_total", queue="mq") == 2
    assert delta("scheduler_runs_failed_total", queue="mq") == 2  # one fail, one reaped
    assert delta("scheduler_runs_dead_total", queue="mq") == 2  # maxAttempts 1
    assert delta("scheduler_lease_expirations_total", queue="mq", outcome="lease_expired") == 1
    assert delta("scheduler_stale_token_rejections_total", call="heartbeat") == 1
    assert delta("scheduler_stale_token_rejections_total", call="complete") == 1
    assert delta("scheduler_claim_batch_size_count") >= 1
    assert value(after, "scheduler_dlq_size", team="team-a") == 2


def test_a_lease_that_expired_and_a_cancel_ended_by_expiry_are_not_stale_or_failed(api_a, team_a):
    """A heartbeat of a lease that expired with its token still the run's counted as a stale
    token (the SDK asks on until the reaper has the run), and a cancelled run whose worker never
    reported, ended `cancelled` by the reaper, as a failure."""
    from apps.runs.ids import parse_run_id
    from apps.runs.models import Run

    definition = make_definition(team_a, "m.expiry", queue="xq", retry_max_attempts=1)
    add_ready_runs(definition, 2)
    before = scrape(api_a)
    expired, cancelled = api_a.lease(["xq"], 2)
    assert api_a.post(f"/api/v1/runs/{cancelled['runId']}/cancel").status_code == 202
    for lease in (expired, cancelled):
        expire_lease(parse_run_id(lease["runId"]))
    beat = api_a.post(
        f"/api/v1/runs/{expired['runId']}/heartbeat", {"fencingToken": expired["fencingToken"]}
    )
    assert beat.status_code == 409 and beat.json()["type"].endswith("/lease-expired")
    store.reap()
    after = scrape(api_a)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert Run.objects.get(pk=parse_run_id(cancelled["runId"])).state == "cancelled"
    assert delta("scheduler_stale_token_rejections_total", call="heartbeat") == 0
    assert delta("scheduler_runs_failed_total", queue="xq") == 1
    assert delta("scheduler_runs_dead_total", queue="xq") == 1
    expirations = sum(
        sample - before.get(key, 0.0)
        for key, sample in after.items()
        if key[0] == "scheduler_lease_expirations_total" and ("queue", "xq") in key[1]
    )
    assert expirations == 2


def test_queue_depth_matches_the_database(api_a, team_a):
    add_ready_runs(make_definition(team_a, "m.crit", queue="depth", priority="critical"), 4)
    add_ready_runs(make_definition(team_a, "m.bulk", queue="depth", priority="bulk"), 7)
    samples = scrape(api_a)
    assert (
        value(samples, "scheduler_queue_depth", team="team-a", queue="depth", priority="critical")
        == 4
    )
    assert (
        value(samples, "scheduler_queue_depth", team="team-a", queue="depth", priority="bulk") == 7
    )
    assert (
        value(
            samples,
            "scheduler_oldest_ready_age_seconds",
            team="team-a",
            queue="depth",
            priority="bulk",
        )
        > 0
    )


def test_every_shard_is_reported_owned_or_not_before_any_scheduler_ran(api_a, settings):
    """Only shards with a lease row had a series: on a database no scheduler had run on, the
    ShardWithoutOwner alert (`sum by (shard) (scheduler_shard_owned) == 0`) had nothing to see."""
    samples = scrape(api_a)
    owned = {
        dict(labels)["shard"]: sample
        for (name, labels), sample in samples.items()
        if name == "scheduler_shard_owned"
    }
    assert owned == {str(shard): 0.0 for shard in range(settings.SCHEDULER_SHARD_COUNT)}


def test_an_open_transaction_shows_its_age(api_a):
    """Another session's open transaction is reported until it ends (the scrape's own, and
    sessions that hold none, count nothing)."""
    with other_session() as other:
        other.execute("SELECT txid_current()")  # a transaction, then idle in it
        time.sleep(1.2)
        held = value(scrape(api_a), "scheduler_oldest_transaction_seconds")
        other.rollback()
        after = value(scrape(api_a), "scheduler_oldest_transaction_seconds")
    assert held >= 1.0
    assert after < 1.0


@pytest.mark.django_db(transaction=False)
def test_observing_many_amounts_at_once_equals_observing_each():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from apps.runs.metrics import LATENCY_BUCKETS, observe_many

    amounts = [0.0, 0.01, 0.0100001, 0.3, 0.3, 2.5, 59.9, 3600, 3600.5, 1e9]
    exposed = []
    for bulk in (False, True):
        registry = CollectorRegistry()
        child = Histogram("h", "h", ["queue"], buckets=LATENCY_BUCKETS, registry=registry)
        child = child.labels("q")
        if bulk:
            observe_many(child, amounts)
            observe_many(child, [])
        else:
            for amount in amounts:
                child.observe(amount)
        text = generate_latest(registry).decode()
        exposed.append("\n".join(line for line in text.splitlines() if "_created" not in line))
    assert exposed[0] == exposed[1]
    assert 'h_bucket{le="0.01",queue="q"} 2.0' in exposed[1]
    assert 'h_bucket{le="+Inf",queue="q"} 10.0' in exposed[1]


def test_dead_row_versions_and_autovacuum_are_reported(api_a, team_a):
    """Updates leave dead versions; the gauge shows PostgreSQL's count once the session that
    made them has reported its statistics (at its end), and whether autovacuum runs."""
    definition = make_definition(team_a, name="dead.rows")
    add_ready_runs(definition, 30)
    before = value(scrape(api_a), "scheduler_dead_row_versions", table="runs_run")
    with other_session(autocommit=True) as other:
        other.execute("UPDATE runs_run SET lease_seconds = lease_seconds + 1")
        autovacuum = other.execute("SHOW autovacuum").fetchone()[0] == "on"
    samples = scrape(api_a)
    # Autovacuum may remove some in between, but not 30 at once within the naptime of a minute.
    assert value(samples, "scheduler_dead_row_versions", table="runs_run") >= before + 20
    assert value(samples, "scheduler_autovacuum_enabled") == (1.0 if autovacuum else 0.0)


def test_a_rate_limited_jobs_window_is_a_gauge(api_a, team_a):
    limited = make_definition(
        team_a, "mail.limited", queue="mail", rate_limit_count=3, rate_limit_period_seconds=60
    )
    add_ready_runs(limited, 5)
    before = scrape(api_a)
    assert value(before, "scheduler_rate_limit", job="mail.limited") == 3
    assert value(before, "scheduler_rate_limit_used", job="mail.limited") == 0
    assert len(api_a.lease(["mail"], 5)) == 3
    after = scrape(api_a)
    assert value(after, "scheduler_rate_limit_used", job="mail.limited") == 3


def test_with_the_database_unreadable_the_counters_are_still_served(api_a, team_a):
    """The gauges' tables unreadable (a database not migrated, or down): /metrics was a 500,
    and an operator lost the counters during the very incident. Now the counters, and the
    gauges saying they could not be read."""
    from django.db import connection

    definition = make_definition(team_a, "m.kept", queue="kept")
    add_ready_runs(definition, 1)
    api_a.lease(["kept"], 1)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE teams_team RENAME TO teams_team_away")
        try:
            samples = scrape(api_a)
        finally:
            cursor.execute("ALTER TABLE teams_team_away RENAME TO teams_team")
    assert value(samples, "scheduler_database_gauges_readable") == 0
    assert value(samples, "scheduler_runs_started_total", queue="kept", priority="default") >= 1
    assert value(scrape(api_a), "scheduler_database_gauges_readable") == 1


def test_every_metric_the_alert_rules_read_is_served(api_a):
    """docs/alerts.yml is read by Prometheus, not by this code: a rule on a metric renamed or
    never served cannot fire, and nothing else would tell."""
    import re
    from pathlib import Path

    import yaml

    rules = yaml.safe_load((Path(__file__).parents[2] / "docs/alerts.yml").read_text())
    read = {
        re.sub(r"_(bucket|total|count|sum)$", "", name)
        for group in rules["groups"]
        for rule in group["rules"]
        for name in re.findall(r"\bscheduler_[a-z_]+", rule["expr"])
    }
    served = {family.name for family in text_string_to_metric_families(api_a.get("/metrics").text)}
    assert read and read <= served, read - served
