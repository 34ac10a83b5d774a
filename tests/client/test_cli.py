"""`python -m cronlease_client run …` as a real subprocess: signals, grace period, crash recovery."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import cronlease_client
import httpx
import pytest
from cronlease_client import Context, load_handlers
from cronlease_client.cli import main

from apps.runs import store
from apps.runs.ids import public_run_id
from apps.runs.models import Attempt, Run
from tests.client.conftest import read_ledger, runs_when, wait_for
from tests.conftest import add_ready_runs, expire_lease, make_definition

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = Path(cronlease_client.__file__).resolve().parents[1]


@pytest.fixture
def spawn_worker(
    live_server, worker_token_a, ledger, tmp_path
) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start `python -m cronlease_client run examples.plain_worker.handlers` subprocesses."""
    processes: list[tuple[subprocess.Popen, Path]] = []

    def spawn(queue: str, *options: str) -> subprocess.Popen:
        log = tmp_path / f"worker-{len(processes)}.log"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(CLIENT_DIR)]),
            "CRONLEASE_URL": live_server.url,
            "CRONLEASE_TOKEN": worker_token_a,
            "PLAIN_WORKER_DB": str(ledger),
        }
        command = [
            sys.executable,
            "-m",
            "cronlease_client",
            "run",
            "examples.plain_worker.handlers",
            "--queue",
            queue,
            "--wait-seconds",
            "1",
            "--log-level",
            "DEBUG",
            *options,
        ]
        with log.open("w") as out:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
        processes.append((process, log))
        return process

    yield spawn
    for process, log in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        # Shown by pytest only when the test failed.
        print(f"--- {log.name} (exit {process.returncode})\n{log.read_text()}")


def wait_leased(pk: int) -> Run:
    return wait_for(
        lambda: Run.objects.filter(pk=pk, state="leased").first(), what=f"run {pk} leased"
    )


def wait_handed(log: Path, pk: int) -> None:
    """Until the worker (logging at DEBUG) has handed the run to a handler. Leased is the
    server's side: a signal before the answer reached the worker leaves nothing running."""
    line = f"leased run_id={public_run_id(pk)} "
    wait_for(lambda: line in log.read_text(), what=f"run {pk} handed to a handler")


pytestmark = pytest.mark.django_db(transaction=True)


def test_sigterm_lets_the_running_handler_finish_and_report(team_a, spawn_worker, ledger, tmp_path):
    definition = make_definition(team_a, "demo.sleep", queue="sig", payload={"seconds": 2})
    (pk,) = add_ready_runs(definition, 1)
    worker = spawn_worker("sig", "--concurrency", "1", "--grace-seconds", "20")
    wait_handed(tmp_path / "worker-0.log", pk)

    worker.send_signal(signal.SIGTERM)
    (later,) = add_ready_runs(definition, 1, prefix="after-sigterm")
    assert worker.wait(timeout=30) == 0

    run = Run.objects.get(pk=pk)
    assert (run.state, run.attempt, run.result) == (
        "succeeded",
        1,
        {"slept": 2.0, "recorded": True},
    )
    assert read_ledger(ledger)[run.idempotency_key]["fencing_token"] == run.fencing_token
    # Stopped leasing: the run added after SIGTERM was never claimed.
    assert Run.objects.get(pk=later).attempt == 0


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_a_handler_past_the_grace_period_is_failed_retryable_and_runs_again(
    team_a, spawn_worker, make_worker, pool
):
    definition = make_definition(
        team_a, "demo.sleep", queue="grace", payload={"seconds": 60}, retry_base_seconds=0
    )
    (pk,) = add_ready_runs(definition, 1)
    worker = spawn_worker("grace", "--grace-seconds", "1", "--pool", pool)
    wait_leased(pk)
    # The run is leased once the claim commits; its answer is still on its way to the worker.
    # A stop then hangs up on it (tests/client/test_worker.py has that case): this one is
    # about a handler that is running, so give the answer time to arrive.
    time.sleep(1.0)

    started = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0
    assert time.monotonic() - started < 10

    run = Run.objects.get(pk=pk)
    assert (run.state, run.attempt) == ("retrying", 1)
    assert run.last_error["type"] == "WorkerShutdown"
    first = Attempt.objects.get(run_id=pk, number=1)
    assert (first.outcome, first.error_type) == ("failed", "WorkerShutdown")

    make_worker(["grace"], handlers={"demo.sleep": lambda ctx: {"quick": True}}).start()
    (run,) = wait_for(runs_when([pk], "succeeded"), what="the retry to succeed")
    assert (run.attempt, run.result) == (2, {"quick": True})


def test_after_sigkill_the_next_lease_has_a_larger_token_and_the_old_one_is_refused(
    live_server, team_a, worker_token_a, spawn_worker, make_worker, ledger
):
    definition = make_definition(
        team_a, "demo.sleep", queue="crash", payload={"seconds": 60}, retry_base_seconds=0
    )
    (pk,) = add_ready_runs(definition, 1)
    worker = spawn_worker("crash")
    first_token = wait_leased(pk).fencing_token

    worker.kill()
    worker.wait(timeout=10)
    expire_lease(pk)
    assert [(reaped.id, reaped.outcome) for reaped in store.reap()] == [(pk, "lease_expired")]

    tokens: list[int] = []

    def quick(ctx: Context) -> dict[str, int]:
        tokens.append(ctx.fencing_token)
        return {"token": ctx.fencing_token}

    make_worker(["crash"], handlers={"demo.sleep": quick}).start()
    (run,) = wait_for(runs_when([pk], "succeeded"), what="the second worker's success")
    assert tokens == [run.fencing_token]
    assert run.fencing_token > first_token

    # The first worker's completion, arriving late (as after a network partition): refused.
    run_id = public_run_id(pk)
    headers = {"Authorization": f"Bearer {worker_token_a}"}
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=10) as http:
        single = http.post(
            f"/api/v1/runs/{run_id}/complete", json={"fencingToken": first_token, "result": {}}
        )
        batch = http.post(
            "/api/v1/results",
            json={
                "results": [{"runId": run_id, "fencingToken": first_token, "outcome": "succeeded"}]
            },
        )
    assert single.status_code == 409
    assert single.json()["status"] == 409
    assert batch.status_code == 200
    assert batch.json()["results"][0]["status"] == 409
    run.refresh_from_db()
    assert (run.state, run.attempt, run.result) == ("succeeded", 2, {"token": tokens[0]})
    assert read_ledger(ledger) == {}


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        # A zombie has been reaped by no one yet but runs nothing: count it as gone.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_pool_processes_do_not_outlive_a_killed_worker(team_a, spawn_worker):
    definition = make_definition(team_a, "demo.sleep", queue="orphans", payload={"seconds": 60})
    (pk,) = add_ready_runs(definition, 1)
    worker = spawn_worker("orphans", "--pool", "process", "--concurrency", "2")
    wait_leased(pk)

    # The resource tracker, the manager and the pool process running the handler; the last two
    # ignore SIGTERM and SIGINT on purpose.
    def started() -> set[int] | None:
        found = children_of(worker.pid)
        return found if len(found) >= 3 else None

    children = wait_for(started, what="the pool processes")

    worker.kill()
    worker.wait(timeout=10)
    try:
        wait_for(lambda: not any(alive(pid) for pid in children), timeout=15, what="orphans gone")
    finally:
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_second_sigint_exits_at_once(team_a, spawn_worker, tmp_path):
    definition = make_definition(team_a, "demo.sleep", queue="int", payload={"seconds": 60})
    (pk,) = add_ready_runs(definition, 1)
    worker = spawn_worker("int", "--grace-seconds", "60")
    wait_handed(tmp_path / "worker-0.log", pk)

    worker.send_signal(signal.SIGINT)
    time.sleep(0.5)
    worker.send_signal(signal.SIGINT)
    assert worker.wait(timeout=10) == 130
    # Nothing reported: the lease is left to expire and the reaper to retry it.
    assert Run.objects.get(pk=pk).state == "leased"


def test_handlers_come_from_the_decorator_registry_and_a_handlers_dict(tmp_path, monkeypatch):
    found = load_handlers("examples.plain_worker.handlers")
    assert {"billing.record-charge", "demo.sleep", "demo.flaky"} <= set(found)
    assert found["billing.record-charge"].dry_run is True
    assert found["demo.sleep"].dry_run is False

    (tmp_path / "dict_handlers.py").write_text(
        "def export(ctx):\n    return 1\n\nHANDLERS = {'reports.export': export}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_handlers("dict_handlers")["reports.export"].func(None) == 1


def test_an_unknown_module_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["run", "no_such_module", "--queue", "q", "--url", "http://x", "--token", "t"])
    assert caught.value.code == 2
    assert "cannot import no_such_module" in capsys.readouterr().err


def test_the_cli_needs_a_url_and_a_token(monkeypatch, capsys):
    monkeypatch.delenv("CRONLEASE_URL", raising=False)
    monkeypatch.delenv("CRONLEASE_TOKEN", raising=False)
    with pytest.raises(SystemExit) as caught:
        main(["run", "examples.plain_worker.handlers", "--queue", "q"])
    assert caught.value.code == 2
    assert "CRONLEASE_URL" in capsys.readouterr().err


def test_a_sigterm_while_the_handlers_import_exits_0_at_once(tmp_path):
    """Nothing is leased before the worker starts: a SIGTERM then (a slow handlers module, a
    supervisor stopping it early) exits 0 at once rather than killing it (-15)."""
    (tmp_path / "slow_handlers.py").write_text(
        "import sys, time\nprint('importing', flush=True)\ntime.sleep(30)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(CLIENT_DIR)]),
        "CRONLEASE_URL": "http://127.0.0.1:9",
        "CRONLEASE_TOKEN": "jst_unused",
    }
    command = [sys.executable, "-m", "cronlease_client", "run", "slow_handlers", "--queue", "q"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "importing\n"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert time.monotonic() - started < 5
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
