"""A token over its rate gets 429 with Retry-After; another token is not slowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.cache import cache

from apps.api import throttling
from apps.api.throttling import Window
from apps.teams.models import ApiToken
from tests.conftest import flushed_redis, redis_test_url

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.django_db(transaction=True)


def test_throttled_token_gets_429_and_others_do_not(api_a, api_b, settings):
    cache.clear()
    settings.SCHEDULER_API_RATES = {"worker": "1000/s", "manage": "5/min"}
    statuses = [api_a.get("/api/v1/jobs").status_code for _ in range(7)]
    assert statuses[:5] == [200] * 5 and statuses[5:] == [429, 429]
    answer = api_a.get("/api/v1/jobs")
    assert answer.status_code == 429
    assert int(answer.headers["Retry-After"]) > 0
    assert answer.json()["status"] == 429
    assert api_b.get("/api/v1/jobs").status_code == 200
    # The worker budget is separate from the management one.
    assert api_a.post("/api/v1/leases", {"queues": ["q"], "workerId": "w"}).status_code == 200
    cache.clear()


class Clock:
    """The throttle's clock, set by the test."""

    def __init__(self, at: float) -> None:
        self.at = at

    def time(self) -> float:
        return self.at


def test_the_budget_slides_no_burst_of_twice_the_rate_at_a_windows_edge(monkeypatch):
    """Ten a minute, all spent in the last instant of a minute: the next minute is still
    refused (a fixed window let ten more through at once; two halves weighted, nine), until
    the slice they were counted in slides out, which Retry-After says to the tenth of a
    second."""
    cache.clear()
    clock = Clock(600 * 60 - 0.1)  # 0.1 s before a minute ends
    monkeypatch.setattr(throttling, "time", clock)
    assert [Window("t", 1, "10/min").spend(1) for _ in range(11)] == [True] * 10 + [False]
    clock.at += 0.2  # 0.1 s into the next minute
    window = Window("t", 1, "10/min")
    assert not window.spend(1)
    # Counted in the minute's last 6 s slice, the ten weigh a tenth less once 0.6 s of that
    # slice has slid out of the last minute: 54.6 s after the minute began.
    assert window.wait == pytest.approx(54.5)
    clock.at += window.wait - 0.1
    assert not Window("t", 1, "10/min").spend(1)
    clock.at += 0.2
    assert Window("t", 1, "10/min").spend(1)
    assert not Window("t", 1, "10/min").spend(1)
    cache.clear()


def test_a_client_that_waits_out_retry_after_is_served(monkeypatch):
    """Retry-After is when the same call fits (nothing else spent): not a second early."""
    cache.clear()
    clock = Clock(0)
    monkeypatch.setattr(throttling, "time", clock)
    for at, calls in ((1000.05, 1), (1000.35, 1), (1000.65, 1), (1000.85, 2)):  # five a second
        clock.at = at
        assert all(Window("t", 2, "5/s").spend(1) for _ in range(calls))
    refused = Window("t", 2, "5/s")
    assert not refused.spend(1)
    clock.at += refused.wait - 0.01
    assert not Window("t", 2, "5/s").spend(1)
    clock.at += 0.02
    assert Window("t", 2, "5/s").spend(1)
    cache.clear()


REDIS_URL = os.environ.get("THROTTLE_TEST_REDIS") or redis_test_url(0)


@pytest.fixture
def shared_cache(settings) -> Iterator[Any]:
    """The cache on a flushed Redis database, configured as REDIS_URL configures it."""
    with flushed_redis(REDIS_URL) as client:
        settings.CACHES = json.loads(in_a_process_with_redis(CACHES))
        yield client


def in_a_process_with_redis(program: str, *args: str) -> str:
    """The last line `program` prints, run in a Django process started with REDIS_URL set."""
    env = {
        **os.environ,
        "REDIS_URL": REDIS_URL,
        "DJANGO_SETTINGS_MODULE": "scheduler_site.settings",
    }
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()\n" + program, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


CACHES = "import json; from django.conf import settings; print(json.dumps(settings.CACHES))"
# Another process's throttle: the same budget, spent in its own memory and connections.
SPEND = """
import sys
from apps.api.throttling import Window
print("allowed" if Window("manage", int(sys.argv[1]), "4/h").spend(1) else "refused")
"""


def test_with_redis_every_web_process_spends_the_same_budget(api_a, team_a, shared_cache, settings):
    """With REDIS_URL set, a token's budget is one across web processes: calls to this one use
    it up, and another process (started apart, with REDIS_URL) is refused."""
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "4/h", "enqueue": ""}
    assert [api_a.get("/api/v1/jobs").status_code for _ in range(4)] == [200] * 4
    token = ApiToken.objects.get(team=team_a)
    assert in_a_process_with_redis(SPEND, str(token.pk)) == "refused"
    assert api_a.get("/api/v1/jobs").status_code == 429
    assert any(key.startswith(b"cronlease:") for key in shared_cache.keys())


def test_an_unreachable_cache_lets_calls_through_and_says_so(api_a, settings, caplog, monkeypatch):
    """Rate limits do not take the API down with Redis."""
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",
        }
    }
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": "1/h", "enqueue": ""}
    monkeypatch.setattr(throttling, "_warned_at", float("-inf"))
    assert [api_a.get("/api/v1/jobs").status_code for _ in range(3)] == [200] * 3
    assert any("rate limits are not counted" in r.getMessage() for r in caplog.records)
