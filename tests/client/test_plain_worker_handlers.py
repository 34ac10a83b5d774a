"""The example's exactly-once write: idempotency key against retries, fencing token against zombies."""

from __future__ import annotations

import threading

from cronlease_client import Context

from examples.plain_worker.handlers import record_once
from tests.client.conftest import read_ledger


def attempt(key: str, token: int, number: int = 1) -> Context:
    return Context(
        run_id="run_1",
        job="billing.record-charge",
        attempt=number,
        idempotency_key=key,
        fencing_token=token,
        payload={},
        due_at=None,
        dry_run=False,
        lease_lost=threading.Event(),
    )


def test_a_retry_does_not_apply_the_effect_twice(ledger):
    assert record_once(attempt("charge@1", 5), {"amountCents": 100}) is True
    assert record_once(attempt("charge@1", 8, number=2), {"amountCents": 100}) is False
    assert record_once(attempt("charge@2", 9), {"amountCents": 100}) is True
    effects = read_ledger(ledger)
    assert {key: row["fencing_token"] for key, row in effects.items()} == {
        "charge@1": 5,
        "charge@2": 9,
    }


def test_a_superseded_attempt_cannot_write(ledger):
    # The newer attempt (token 8) got there first; the zombie with token 5 wakes up afterwards.
    assert record_once(attempt("charge@1", 8, number=2), {"by": "new"}) is True
    assert record_once(attempt("charge@1", 5), {"by": "zombie"}) is False
    assert read_ledger(ledger)["charge@1"]["detail"] == '{"by": "new"}'
