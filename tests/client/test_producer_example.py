"""The producer example end to end: the application enqueues delayed receipts with the client,
a worker with the example's handler runs them, against the live server."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.runs.models import Run
from examples.producer import app, handlers

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_example_enqueues_delayed_receipts_and_the_worker_sends_them(
    live_server, token_a, make_worker, capsys
):
    worker = make_worker(["shop"], handlers={app.RECEIPT: handlers.send_receipt})
    worker.start()
    argv = ["--url", live_server.url, "--token", token_a, "--orders", "3", "--delay", "1"]

    assert app.main([*argv, "--timeout", "30"]) == 0

    runs = list(Run.objects.select_related("definition").order_by("idempotency_key"))
    assert [run.idempotency_key for run in runs] == ["order-1000", "order-1001", "order-1002"]
    for number, run in enumerate(runs, start=1000):
        assert run.state == "succeeded"
        assert run.definition.queue == "shop"
        assert run.result == {
            "sent": number,
            "to": f"customer-{number}@example.com",
            "key": f"order-{number}",
        }
        # created_at is read a moment after the clock the delay counts from
        assert run.available_at - run.created_at >= timedelta(seconds=0.9)
        assert run.started_at >= run.available_at
    assert capsys.readouterr().out.count(" succeeded ") == 3

    # Placing the same orders again sends nothing twice: their keys name the runs made.
    assert app.main([*argv, "--timeout", "5"]) == 0
    assert Run.objects.count() == 3
