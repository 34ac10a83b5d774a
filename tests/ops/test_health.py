"""/healthz and /readyz, with the scheduler heartbeat."""

from __future__ import annotations

import httpx
import pytest

from apps.scheduler import leases

pytestmark = pytest.mark.django_db(transaction=True)


def test_health_and_readiness_show_the_schedulers(live_server):
    assert httpx.get(f"{live_server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{live_server.url}/readyz").json()
    assert ready["status"] == "ok" and ready["schedulers"] == []
    # No scheduler has ever run: every shard is unowned, not none.
    assert ready["unownedShards"] == 16
    assert ready["shardDatabases"] == [
        {"shards": "0-15", "reachable": True, "depth": 0, "lagSeconds": 0.0}
    ]
    from apps.scheduler.daemon import Scheduler

    node = Scheduler(node_id="node-a")
    node.handle_one_lease_round()
    ready = httpx.get(f"{live_server.url}/readyz").json()
    assert [s["node"] for s in ready["schedulers"]] == ["node-a"]
    assert ready["schedulers"][0]["shards"] == 16 and ready["unownedShards"] == 0
    leases.leave("node-a")
    assert httpx.get(f"{live_server.url}/readyz").json()["unownedShards"] == 16


def test_a_database_not_migrated_at_all_is_unready_for_its_migrations(client):
    """Its reason was the first missing table's error (`relation "scheduler_schedulernode" does
    not exist`), not the migrations pending."""
    import psycopg
    from django.db import DEFAULT_DB_ALIAS, connections

    connection = connections[DEFAULT_DB_ALIAS]
    params = connection.get_connection_params()
    empty = f"{params['dbname']}_empty"
    with psycopg.connect(**{**params, "dbname": "postgres"}, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{empty}"')
        admin.execute(f'CREATE DATABASE "{empty}"')
    named = connection.settings_dict["NAME"]
    connection.close()
    connection.settings_dict["NAME"] = empty
    try:
        answer = client.get("/readyz")
    finally:
        connection.close()
        connection.settings_dict["NAME"] = named
        with psycopg.connect(**{**params, "dbname": "postgres"}, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{empty}"')
    assert answer.status_code == 503
    assert answer.json()["detail"].endswith(" migrations pending"), answer.json()
