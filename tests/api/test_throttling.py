"""A token over its rate gets 429 with Retry-After; another token is not slowed."""

from __future__ import annotations

import pytest
from django.core.cache import cache

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
