"""The README's run command, as a new user runs it: no database installed, one command.

The test starts `manage.py dev` with no DATABASE_URL (so it starts its own PostgreSQL in a
fresh data folder), waits for the API, watches a demo run succeed and the flaky job reach the
dead-letter queue, then sends SIGINT and checks that every process it started has exited.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from scheduler_site import embedded_db
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children_of(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def listed(api: httpx.Client, path: str, **params: str) -> list:
    """A list's results; none while the token's rate limit answers 429 (the waits below poll
    twenty times a second, the manage scope's limit)."""
    answer = api.get(path, params=params)
    if answer.status_code == 429:
        return []
    assert answer.status_code == 200, answer.text
    return answer.json()["results"]


def dev_environment(data: Path) -> dict[str, str]:
    """This process's environment for `manage.py dev` with its own database in `data`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DATABASE_URL", "TEST_DATABASE_NAME"}
    }
    env.update({"SCHEDULER_DATA_DIR": str(data), "PYTHONUNBUFFERED": "1"})
    return env


def token_printed(output: list[str]) -> str:
    return wait_for(
        lambda: next(
            (m.group(1) for line in output if (m := re.search(r"Token:\s+(\S+)", line))), None
        ),
        120,
        "the token line",
    )


def started_dev(args: list[str], data: Path) -> tuple[subprocess.Popen, list[str]]:
    """`manage.py dev` with `args` on the data folder `data`: its process, and the lines it
    prints (read by a thread as they come)."""
    process = subprocess.Popen(
        [sys.executable, "manage.py", "dev", *args],
        cwd=ROOT,
        env=dev_environment(data),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(process.stdout), daemon=True).start()
    return process, output


def test_run_command_brings_the_demo_up_and_stops_cleanly(tmp_path):
    port = free_port()
    process, output = started_dev(["--port", str(port)], tmp_path / "data")
    try:
        token = token_printed(output)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(f"{base}/healthz") == 200, 60, "the web process")
        api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        wait_for(
            lambda: listed(api, "/api/v1/runs", state="succeeded"),
            90,
            "a succeeded run",
        )
        dead = wait_for(lambda: listed(api, "/api/v1/dlq"), 90, "the flaky job in the DLQ")
        assert dead[0]["job"] == "demo.flaky" and dead[0]["attempt"] == 2
        jobs = wait_for(lambda: listed(api, "/api/v1/jobs"), 10, "the job list")
        assert {job["name"] for job in jobs} >= {
            "demo.nightly-report",
            "demo.every-minute",
            "demo.flaky",
            "demo.delayed-email",
            "demo.partner-sync",
        }
        # A rate-limited queue in use, and a run started later than its job's SLO.
        wait_for(
            lambda: any(
                q["name"] == "demo-throttled" and q["rateLimit"] and q["rateUsed"] == 1
                for q in listed(api, "/api/v1/queues")
            ),
            60,
            "the throttled queue's window in use",
        )
        late = wait_for(lambda: listed(api, "/api/v1/alerts"), 60, "a late run")
        assert late[0]["kind"] == "late" and late[0]["job"] == "demo.partner-sync"
        started = children_of(process.pid)
        assert len(started) >= 3, started  # web, scheduler, worker

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, "".join(output[-40:])
        wait_for(lambda: not any(alive(pid) for pid in started), 10, "the children to exit")

        # The database outlives `make run` on purpose; `make stop-db` ends it (as root too,
        # where the server runs as pgserver's own user and pg_ctl refuses to run).
        postmaster = int((tmp_path / "data" / "pg" / "postmaster.pid").read_text().split()[0])
        assert alive(postmaster)
        # Relative, as `make stop-db` names it (.data).
        assert embedded_db.stop(Path(os.path.relpath(tmp_path / "data")))
        assert not alive(postmaster)
    finally:
        if process.poll() is None:
            process.kill()
        for pid in children_of(process.pid):
            os.kill(pid, signal.SIGKILL)
        embedded_db.stop(tmp_path / "data")


def test_a_second_dev_on_the_data_folder_of_a_running_one_refuses_and_changes_nothing(tmp_path):
    """A second `manage.py dev` (`make run` in another terminal) on the data folder of a running
    one revoked the running demo worker's token and emptied the metrics folder its processes
    count in, then stopped, finding the port taken: that worker was refused from then on, and
    the running /metrics lost its counts for good."""
    port = free_port()
    data = tmp_path / "data"
    command = [sys.executable, "manage.py", "dev", "--no-worker", "--port", str(port)]
    process, output = started_dev(command[3:], data)
    try:
        token = token_printed(output)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(f"{base}/metrics") == 200, 60, "the web process")
        counts = {entry.name: entry.stat().st_ino for entry in (data / "prometheus").iterdir()}
        assert counts, "the web and scheduler processes count in the folder"

        again = subprocess.run(
            command,
            cwd=ROOT,
            env=dev_environment(data),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 1, again.stdout + again.stderr
        assert "Another `manage.py dev` (or a process it started) runs on" in again.stderr
        kept = {entry.name: entry.stat().st_ino for entry in (data / "prometheus").iterdir()}
        assert counts.items() <= kept.items()  # the same files, not emptied and made again
        headers = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"{base}/api/v1/jobs", headers=headers, timeout=10).status_code == 200

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, "".join(output[-40:])
    finally:
        if process.poll() is None:
            process.kill()
        for pid in children_of(process.pid):
            os.kill(pid, signal.SIGKILL)
        embedded_db.stop(data)


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0
