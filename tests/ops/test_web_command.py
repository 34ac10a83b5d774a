"""`manage.py web`: uvicorn worker processes behind one socket whose connections send at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
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
    config = uvicorn.Config(APPLICATION, host="127.0.0.1", port=0)
    with closing(listening_socket(config)) as ours:
        assert accepted_nodelay(ours)
    # Why the command makes its own: uvicorn's socket leaves Nagle on for every connection.
    with closing(config.bind_socket()) as plain:
        assert not accepted_nodelay(plain)


@pytest.mark.slow
def test_serves_with_several_workers_and_stops_on_sigterm():
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Only 10.0.0.0/8 may read /metrics: this test, on 127.0.0.1, may not.
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SCHEDULER_OPS_ALLOWED_NETWORKS": "10.0.0.0/8",
        "LOG_FORMAT": "json",
    }
    env.pop("SCHEDULER_BEHIND_PROXY", None)
    env.setdefault("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    web = subprocess.Popen(
        [sys.executable, "manage.py", "web", "--port", str(port), "--workers", "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert web.poll() is None, web.communicate()[0]
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the web process never answered"
                time.sleep(0.2)
        assert answer.status_code == 200
        # Not behind a proxy, a caller's X-Forwarded-For is not its address.
        url = f"http://127.0.0.1:{port}/metrics"
        assert httpx.get(url, headers={"X-Forwarded-For": "10.1.1.1"}).status_code == 403
        web.send_signal(signal.SIGTERM)
        output, _ = web.communicate(timeout=30)
        assert web.returncode == 0, output
        # Two worker processes served and were stopped.
        assert output.count("Finished server process") == 2, output
        # Every line JSON, uvicorn's own (access, start, stop) included.
        lines = [json.loads(line) for line in output.splitlines() if line.strip()]
        assert any('"GET /healthz HTTP/1.1" 200' in line["msg"] for line in lines), output
    finally:
        if web.poll() is None:
            web.kill()
            web.wait()
