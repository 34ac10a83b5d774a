"""The outbox under failure: a scheduler killed (SIGKILL) between the event and its delivery,
and the daemons that come after it sending side by side: every page is sent exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest
from django.db import connections

from apps.notify import outbox
from apps.notify.loop import Notifier
from apps.notify.models import Delivery, Incident, State
from apps.runs.clock import database_now
from tests.conftest import child_database_url, child_shard_env, make_definition
from tests.notify.conftest import die, make_channel, messages_of

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parents[2]

# The scheduler's notifier steps in a process of their own: detect (the incident and its
# outbox rows commit together), say so, and wait to be killed before sending anything.
DETECT_THEN_HANG = """
import time
import django
django.setup()
from apps.notify import detect
from apps.notify.loop import Notifier
detect.SETTLE_SECONDS = 0
Notifier().handle_one_detection(force=True)
print("detected", flush=True)
time.sleep(60)
"""


def test_a_page_written_before_a_kill_is_sent_exactly_once_by_the_daemons_after_it(
    team_a, receiver
):
    job = make_definition(team_a, "billing.export", queue="billing", retry_max_attempts=1)
    channel = make_channel(team_a, receiver.url)
    die(job)
    env = {
        **os.environ,
        "DATABASE_URL": child_database_url(),
        **child_shard_env(),
        "SCHEDULER_APPLICATION_NAME": "scheduler:test-notifier",
        "LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(REPO),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", DETECT_THEN_HANG],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        timer = threading.Timer(30, process.kill)
        timer.start()
        assert process.stdout.readline() == b"detected\n"
        timer.cancel()
        (page,) = Delivery.objects.all()
        assert page.state == State.PENDING and page.attempts == 0
        assert receiver.requests == []
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)

    # More pages waiting, then three daemons at once: each row is claimed by one of them.
    now = database_now()
    for n in range(20):
        outbox.enqueue(
            [channel],
            event="test",
            phase="test",
            summary=f"message {n}",
            body=orjson.dumps({"event": "test", "phase": "test", "n": n}).decode(),
            now=now,
        )
    assert not Notifier().handle_one_detection(force=True)  # nothing new to page

    def daemon() -> None:
        try:
            notifier = Notifier()
            while notifier.handle_one_delivery():
                pass
        finally:
            connections.close_all()

    threads = [threading.Thread(target=daemon) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert messages_of(receiver).count(("run.dead", "open")) == 1
    assert len(receiver.requests) == 21
    assert len({r.body for r in receiver.requests}) == 21
    assert set(Delivery.objects.values_list("state", "attempts")) == {(State.SENT, 1)}
    assert Incident.objects.count() == 1
