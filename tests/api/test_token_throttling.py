"""Unknown or revoked bearer tokens are throttled per client address, and then cost no lookup."""

from __future__ import annotations

import time

import pytest

from apps.teams.models import ApiTokenQuerySet
from tests.conftest import Api

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = {"queues": ["q"], "max": 1, "workerId": "w"}
GUESSER = "203.0.113.7"
NEIGHBOUR = "198.51.100.2"


@pytest.fixture
def three_guesses_a_minute(settings):
    settings.SCHEDULER_TOKEN_FAILURES_PER_ADDRESS = 3
    settings.SCHEDULER_TOKEN_FAILURE_WINDOW_SECONDS = 60


@pytest.fixture
def behind_proxy(settings):
    settings.SCHEDULER_BEHIND_PROXY = True


def call(live_server, token: str, address: str | None = None, *, path: str = "/api/v1/jobs"):
    api = Api(live_server.url, token)
    headers = {"X-Forwarded-For": f"10.9.9.9, {address}"} if address else {}
    try:
        if path == "/api/v1/leases":
            return api.post(path, LEASE, headers=headers)
        return api.get(path, headers=headers)
    finally:
        api.http.close()


def guess(live_server, count: int, address: str | None = None) -> list[int]:
    return [
        call(live_server, f"jst_guess-{address}-{i}", address).status_code for i in range(count)
    ]


@pytest.fixture
def token_lookups(monkeypatch) -> list[int]:
    """One entry per token read from the database."""
    lookups: list[int] = []
    active = ApiTokenQuerySet.active

    def counted(queryset):
        lookups.append(1)
        return active(queryset)

    monkeypatch.setattr(ApiTokenQuerySet, "active", counted)
    return lookups


def assert_throttled(answer) -> None:
    assert answer.status_code == 429, answer.text
    assert answer.headers["Content-Type"] == "application/problem+json"
    assert 0 < int(answer.headers["Retry-After"]) <= 60
    body = answer.json()
    assert body["status"] == 429 and "unknown or revoked tokens" in body["detail"]


def test_too_many_wrong_tokens_from_one_address_get_429_with_retry_after_on_both_paths(
    live_server, db, three_guesses_a_minute
):
    assert guess(live_server, 3) == [401, 401, 401]
    assert_throttled(call(live_server, "jst_guess-4"))
    assert_throttled(call(live_server, "jst_guess-5", path="/api/v1/leases"))


def test_a_throttled_guess_costs_no_database_lookup(
    live_server, db, three_guesses_a_minute, token_lookups
):
    assert guess(live_server, 3) == [401, 401, 401]
    assert len(token_lookups) == 3
    for i in range(20):
        assert call(live_server, f"jst_more-{i}", path="/api/v1/leases").status_code == 429
        assert call(live_server, f"jst_more-{i}").status_code == 429
    assert len(token_lookups) == 3


def test_a_good_token_from_another_address_is_not_slowed_by_one_addresses_guesses(
    live_server, token_a, three_guesses_a_minute, behind_proxy
):
    assert guess(live_server, 4, GUESSER) == [401, 401, 401, 429]
    assert call(live_server, token_a, NEIGHBOUR).status_code == 200
    assert call(live_server, token_a, NEIGHBOUR, path="/api/v1/leases").status_code == 200
    assert call(live_server, "jst_typo", NEIGHBOUR).status_code == 401


def test_a_token_in_use_keeps_working_from_an_address_that_is_throttled(
    live_server, token_a, worker_token_a, three_guesses_a_minute, behind_proxy, monkeypatch
):
    from apps.api import auth

    monkeypatch.setattr(auth, "CACHE_SECONDS", 0.2)
    assert call(live_server, token_a, GUESSER).status_code == 200
    assert guess(live_server, 4, GUESSER) == [401, 401, 401, 429]
    assert call(live_server, token_a, GUESSER).status_code == 200
    time.sleep(0.3)  # its cache entry expired: read again, not refused as a guess
    assert call(live_server, token_a, GUESSER, path="/api/v1/leases").status_code == 200
    # A token this process has not seen from there waits with the guesses.
    assert_throttled(call(live_server, worker_token_a, GUESSER, path="/api/v1/leases"))


def test_x_forwarded_for_is_not_believed_unless_behind_a_proxy(
    live_server, db, three_guesses_a_minute
):
    statuses = [call(live_server, f"jst_guess-{i}", f"192.0.2.{i}").status_code for i in range(4)]
    assert statuses == [401, 401, 401, 429]


def test_a_revoked_token_counts_as_a_wrong_one(
    live_server, team_a, token_a, three_guesses_a_minute
):
    from django.utils import timezone

    from apps.teams.models import ApiToken

    ApiToken.objects.update(revoked_at=timezone.now())
    assert [call(live_server, token_a).status_code for _ in range(4)] == [401, 401, 401, 429]


def test_the_throttle_lifts_when_its_window_ends(live_server, token_a, settings):
    settings.SCHEDULER_TOKEN_FAILURES_PER_ADDRESS = 2
    settings.SCHEDULER_TOKEN_FAILURE_WINDOW_SECONDS = 1
    assert guess(live_server, 3) == [401, 401, 429]
    assert call(live_server, token_a).status_code == 429
    time.sleep(1.1)
    assert call(live_server, token_a).status_code == 200
    assert guess(live_server, 1) == [401]
