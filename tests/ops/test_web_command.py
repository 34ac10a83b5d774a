"""`manage.py web`: uvicorn worker processes behind one socket whose connections send at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from apps.ops.management.commands.web import APPLICATION, listening_socket

ROOT = Path(__file__).resolve().parents[2]


def accepted_nodelay(listener: socket.socket) -> int:
    listener.listen()
    with closing(socket.create_connection(listener.getsockname()[:2])):
        conn, _ = listener.accept()
        with closing(conn):
            return conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_accepted_connections_inherit_tcp_nodelay():
    config = uvicorn.Config(APPLICATION, factory=True, host="127.0.0.1", port=0)
    with closing(listening_socket(config)) as ours:
        assert accepted_nodelay(ours)
    # Why the command makes its own: uvicorn's socket leaves Nagle on for every connection.
    with closing(config.bind_socket()) as plain:
        assert not accepted_nodelay(plain)


def web_environment(**env: str) -> dict[str, str]:
    """This process's environment for `manage.py web`, with `env` over it."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    environment.pop("SCHEDULER_BEHIND_PROXY", None)
    environment.setdefault("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    return environment


@contextmanager
def web_process(
    *args: str, output: int = subprocess.DEVNULL, **env: str
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`manage.py web` on a free port with `env` over this process's environment, once it
    listens: the process and its URL. Stopped (SIGTERM) at the end unless the test did."""
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    web = subprocess.Popen(
        [sys.executable, "manage.py", "web", "--port", str(port), *args],
        cwd=ROOT,
        env=web_environment(**env),
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert web.poll() is None, web.communicate()[0]
            try:
                with closing(socket.create_connection(("127.0.0.1", port), timeout=1)):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the web process never listened"
                time.sleep(0.2)
        yield web, f"http://127.0.0.1:{port}"
    finally:
        if web.poll() is None:
            web.send_signal(signal.SIGTERM)
            try:
                web.wait(30)
            except subprocess.TimeoutExpired:
                web.kill()
                web.wait()


@pytest.mark.slow
def test_serves_with_several_workers_and_stops_on_sigterm():
    # Only 10.0.0.0/8 may read /metrics: this test, on 127.0.0.1, may not.
    with web_process(
        "--workers", "2", output=subprocess.PIPE,
        SCHEDULER_OPS_ALLOWED_NETWORKS="10.0.0.0/8", LOG_FORMAT="json",
    ) as (web, url):  # fmt: skip
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        # Not behind a proxy, a caller's X-Forwarded-For is not its address.
        metrics = httpx.get(f"{url}/metrics", headers={"X-Forwarded-For": "10.1.1.1"})
        assert metrics.status_code == 403
        web.send_signal(signal.SIGTERM)
        output, _ = web.communicate(timeout=30)
    assert web.returncode == 0, output
    # Two worker processes served and were stopped.
    assert output.count("Finished server process") == 2, output
    # Every line JSON, uvicorn's own (access, start, stop) included.
    lines = [json.loads(line) for line in output.splitlines() if line.strip()]
    assert any('"GET /healthz HTTP/1.1" 200' in line["msg"] for line in lines), output


def _running(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_workers_stop_when_their_supervisor_is_killed_and_free_the_port():
    """Killed with -9, the supervisor left its workers serving on the port, unsupervised: the
    web process started in its place could not bind it and exited."""
    with web_process("--workers", "2") as (web, url):
        found = subprocess.run(["pgrep", "-P", str(web.pid)], capture_output=True, text=True)
        workers = [int(pid) for pid in found.stdout.split()]
        assert len(workers) >= 2, found
        web.kill()
        web.wait()
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in workers):
            assert time.monotonic() < deadline, "the workers outlived their supervisor"
            time.sleep(0.2)
        port = int(url.rsplit(":", 1)[1])
        with closing(socket.socket()) as taker:  # as the next web process binds it
            taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taker.bind(("127.0.0.1", port))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_several_workers_add_up_their_counters_without_a_folder_given(
    tmp_path, team_a, worker_token_a, monkeypatch
):
    """Without PROMETHEUS_MULTIPROC_DIR each worker counted apart, and /metrics (served by one
    of them) jumped between their counts from scrape to scrape."""
    from tests.conftest import add_ready_runs, child_database_url, make_definition

    add_ready_runs(make_definition(team_a, "count.me", queue="count"), 1)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    headers = {"Authorization": f"Bearer {worker_token_a}"}
    with web_process(
        "--workers", "2", DATABASE_URL=child_database_url(), SCHEDULER_DATA_DIR=str(tmp_path),
        SCHEDULER_API_RATE_WORKER="",
    ) as (_, url):  # fmt: skip
        lease = {"queues": ["count"], "max": 1, "workerId": "w", "waitSeconds": 0}
        (leased,) = httpx.post(f"{url}/api/v1/leases", json=lease, headers=headers).json()["leases"]
        stale = {"fencingToken": leased["fencingToken"] + 1000}  # never this run's
        for _ in range(20):  # each on a connection of its own: spread over the two workers
            refused = httpx.post(
                f"{url}/api/v1/runs/{leased['runId']}/heartbeat", json=stale, headers=headers
            )
            assert refused.status_code == 409
        seen = set()
        for _ in range(6):
            text = httpx.get(f"{url}/metrics").text
            (line,) = [
                line
                for line in text.splitlines()
                if line.startswith('scheduler_stale_token_rejections_total{call="heartbeat"}')
            ]
            seen.add(float(line.split()[-1]))
        assert seen == {20.0}
        port = url.rsplit(":", 1)[1]
        assert (tmp_path / "prometheus" / f"web-{port}").is_dir()


@pytest.mark.slow
def test_a_second_start_on_a_port_in_use_leaves_the_running_servers_counts(tmp_path, monkeypatch):
    """A second `manage.py web --workers 2` on the port of a running one (a deploy run twice)
    emptied the metrics folder before it found the port taken, and exited: the running
    server's /metrics lost every count its workers had made, for good."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with web_process("--workers", "2", SCHEDULER_DATA_DIR=str(tmp_path)) as (web, url):
        port = url.rsplit(":", 1)[1]
        folder = tmp_path / "prometheus" / f"web-{port}"
        assert httpx.get(f"{url}/metrics").status_code == 200
        counts = {entry.name: entry.stat().st_ino for entry in folder.iterdir()}
        assert counts, "the workers count in the folder"
        again = subprocess.run(
            [sys.executable, "manage.py", "web", "--workers", "2", "--port", port],
            cwd=ROOT,
            env=web_environment(SCHEDULER_DATA_DIR=str(tmp_path)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode != 0
        assert "address already in use" in again.stderr.lower(), again.stderr
        kept = {entry.name: entry.stat().st_ino for entry in folder.iterdir()}
        assert counts.items() <= kept.items()  # the same files, not emptied and made again
        assert web.poll() is None


@pytest.mark.slow
def test_the_liveness_probe_answers_at_once_while_the_database_hangs(tmp_path):
    """A database server that accepts connections and never answers: /healthz, the first
    request included, answers at once (it waited 10-12 s on the shard map's read)."""
    import threading

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    held: list[socket.socket] = []
    threading.Thread(
        target=lambda: held.extend(iter(lambda: silent.accept()[0], None)), daemon=True
    ).start()
    database = f"postgresql://postgres@127.0.0.1:{silent.getsockname()[1]}/none"
    try:
        with web_process(DATABASE_URL=database, SCHEDULER_DATA_DIR=str(tmp_path)) as (_, url):
            assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    finally:
        silent.close()


def test_a_database_down_from_the_start_is_refused_at_once(tmp_path):
    """The first request to a database whose server was down from the process's start waited
    the pool's whole timeout (10 s) before its breaker learnt of it; the probes after it were
    answered at once."""
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # nothing listens there once the probe is closed
    database = f"postgresql://postgres@127.0.0.1:{closed}/none"
    with web_process(DATABASE_URL=database, SCHEDULER_DATA_DIR=str(tmp_path)) as (_, url):
        started = time.monotonic()
        answer = httpx.get(f"{url}/readyz", timeout=30)
        took = time.monotonic() - started
    assert answer.status_code == 503
    assert took < 5, took


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_stop_answers_the_long_polls_at_once(tmp_path, team_a, worker_token_a):
    """uvicorn stops once every request is answered: a stop (a deploy) waited out each
    worker's long poll, up to its waitSeconds. The polls now answer at the stop."""
    import threading

    from tests.conftest import child_database_url

    headers = {"Authorization": f"Bearer {worker_token_a}"}
    answers: list[tuple[int, dict, float]] = []

    def poll(url: str) -> None:
        lease = {"queues": ["nothing"], "max": 1, "workerId": "w", "waitSeconds": 30}
        started = time.monotonic()
        answer = httpx.post(f"{url}/api/v1/leases", json=lease, headers=headers, timeout=60)
        answers.append((answer.status_code, answer.json(), time.monotonic() - started))

    with web_process(
        "--workers", "2", DATABASE_URL=child_database_url(), SCHEDULER_DATA_DIR=str(tmp_path),
        SCHEDULER_API_RATE_WORKER="",
    ) as (web, url):  # fmt: skip
        polls = [threading.Thread(target=poll, args=(url,)) for _ in range(4)]
        for thread in polls:
            thread.start()
        time.sleep(1)  # each is waiting by now
        stopped = time.monotonic()
        web.send_signal(signal.SIGTERM)
        web.wait(20)
        took = time.monotonic() - stopped
        for thread in polls:
            thread.join(5)
    assert took < 10, took  # before: ~28 s, the polls' waits
    assert [(status, body) for status, body, _ in answers] == [(200, {"leases": []})] * 4
    assert all(waited < 10 for _, _, waited in answers), answers


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_request_behind_a_held_lock_is_answered_503_and_does_not_hold_the_stop(
    tmp_path, team_a, token_a
):
    """A PATCH waiting on a job row another session holds (a psql transaction left open)
    waited as long as that session lived, and held the web process's stop as long."""
    import threading

    import psycopg

    from tests.conftest import child_database_url, make_definition

    make_definition(team_a, "held.job", queue="held", timeout_seconds=900)
    headers = {"Authorization": f"Bearer {token_a}"}
    answers: list[httpx.Response] = []

    def patch(url: str) -> None:
        change = {"timeoutSeconds": 77}
        answers.append(httpx.patch(f"{url}/api/v1/jobs/held.job", json=change, headers=headers))

    with (
        web_process(
            DATABASE_URL=child_database_url(), SCHEDULER_DATA_DIR=str(tmp_path),
            SCHEDULER_DB_LOCK_TIMEOUT="1",
        ) as (web, url),
        psycopg.connect(child_database_url()) as holder,
    ):  # fmt: skip
        holder.execute("SELECT 1 FROM jobs_jobdefinition WHERE name = 'held.job' FOR UPDATE")
        first = threading.Thread(target=patch, args=(url,))
        first.start()
        first.join(15)
        (refused,) = answers
        second = threading.Thread(target=patch, args=(url,))
        second.start()
        time.sleep(0.5)  # waiting on the lock
        stopped = time.monotonic()
        web.send_signal(signal.SIGTERM)
        web.wait(30)
        took = time.monotonic() - stopped
        second.join(5)
        holder.rollback()
    assert refused.status_code == 503, refused.text
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["detail"] == (
        "Another session held a lock this request needs for over 1 s "
        "(SCHEDULER_DB_LOCK_TIMEOUT); nothing was changed; try again."
    )
    assert took < 10, took  # before: as long as the lock was held
    assert answers[1].status_code == 503
    with psycopg.connect(child_database_url()) as check:
        (timeout,) = check.execute(
            "SELECT timeout_seconds FROM jobs_jobdefinition WHERE name = 'held.job'"
        ).fetchone()
    assert timeout == 900


def _exchange(url: str, *parts: bytes) -> bytes:
    """Send raw bytes to the web process, each part in a write of its own a moment after the
    last; its whole answer, once it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with closing(socket.create_connection((host, int(port)), timeout=30)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for n, part in enumerate(parts):
            if n:
                time.sleep(0.2)
            sock.sendall(part)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.slow
def test_a_request_head_past_the_bound_is_refused_by_the_http_server():
    """httptools kept a header in memory whatever its size: 80 MB headers, sent without a
    token, were read whole (a worker's memory to 600 MB with three) and answered 200."""
    with web_process(SCHEDULER_MAX_HEADER_BYTES="65536") as (_, url):
        big = b"X-Big: " + b"a" * 200_000 + b"\r\n"
        refused = _exchange(url, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + big + b"\r\n")
        assert refused.startswith(b"HTTP/1.1 400"), refused[:200]
        assert refused.endswith(b"Request headers larger than 65536 bytes."), refused[-200:]
        many = b"".join(b"X-H%d: v\r\n" % n for n in range(10_000))
        assert _exchange(
            url, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + many + b"\r\n"
        ).startswith(b"HTTP/1.1 400")
        # Under the bound, two requests in one write, and a body far larger than the bound
        # (its own limit is the application's) are served.
        head = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Fill: " + b"f" * 40_000 + b"\r\n"
        both = _exchange(url, head + b"\r\n" + head + b"Connection: close\r\n\r\n")
        assert both.count(b"HTTP/1.1 200") == 2, both[:300]
        body = b"{" + b" " * 900_000 + b"}"
        post = _exchange(
            url,
            b"POST /api/v1/runs HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        )
        assert post.startswith(b"HTTP/1.1 401"), post[:300]
        # The head's blank line split across two writes, the body behind it in the second:
        # the body is not counted as head.
        start = (
            b"POST /api/v1/runs HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r" % len(body)
        )
        split = _exchange(url, start, b"\n" + body)
        assert split.startswith(b"HTTP/1.1 401"), split[:300]
        # Refused behind a request still answered on the connection: the answers in order.
        first = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
        late = _exchange(url, first + b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + big)
        assert late.startswith(b"HTTP/1.1 200") and late.count(b"HTTP/1.1 400") == 1, late[:400]
        assert late.index(b"HTTP/1.1 400") > late.index(b"HTTP/1.1 200")
        # At the bound and one past it, the same answer however the blank line is split.
        line = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nX-Pad: "
        for size, status in [(65_536, b"HTTP/1.1 200"), (65_537, b"HTTP/1.1 400")]:
            request = line + b"p" * (size - len(line)) + b"\r\n\r\n"
            for cut in (0, 1, 2, 3, 4):
                parts = (request,) if not cut else (request[:-cut], request[-cut:])
                answer = _exchange(url, *parts)
                assert answer.startswith(status), (size, cut, answer[:100])
