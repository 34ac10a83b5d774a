"""The web process: the API, the dashboard and its WebSocket, served by uvicorn.

    python manage.py web [--host 0.0.0.0] [--port 8000] [--workers 2]

Use this rather than `uvicorn --workers N` directly: uvicorn's own socket leaves Nagle's algorithm
on for every connection it accepts, so each answer's body waits for the client's delayed ACK of
its headers, 40 ms on every request.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand
from uvicorn.supervisors import Multiprocess

from scheduler_site.http_protocol import BoundedHeadProtocol

# uvicorn calls this factory in each worker process (below).
APPLICATION = "apps.ops.management.commands.web:application"
# A stop cancels what is still running this long after SIGTERM. What could hold it longer is
# bounded apart: long polls answer at the stop, statements wait at most SCHEDULER_DB_LOCK_TIMEOUT
# for a lock and run at most SCHEDULER_DB_STATEMENT_TIMEOUT.
GRACEFUL_STOP_SECONDS = 30
# prctl(2): the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def _bounded(low: int, high: int):
    """An argparse type: a whole number from `low` to `high`, or a usage error saying so."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"a whole number from {low} to {high}")
        return value

    return whole


def listening_socket(config: uvicorn.Config) -> socket.socket:
    """uvicorn's bound socket, with TCP_NODELAY, which accepted connections inherit.

    uvicorn makes the socket without naming its protocol, and asyncio sets TCP_NODELAY only on
    sockets whose protocol is TCP by name."""
    sock = config.bind_socket()
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def application() -> Any:
    """The site's ASGI application, with a stop that ends the long polls.

    uvicorn calls this in each worker process once its own SIGTERM and SIGINT handlers are set
    (it loads the application inside them), and stops only once every request has been
    answered: a stop (a deploy) waited out every worker's long poll, up to its `waitSeconds`.
    Each handler now first tells the long polls to answer what they have."""
    from scheduler_site.asgi import application as site

    for sig in (signal.SIGTERM, signal.SIGINT):
        stop = signal.getsignal(sig)
        if callable(stop):
            signal.signal(sig, functools.partial(_stopping, stop))
    _stop_with_the_supervisor()
    return site


def _stop_with_the_supervisor() -> None:
    """Have Linux send this worker SIGTERM (the stop above) when its supervisor dies: killed
    (-9), the supervisor left its workers serving, unsupervised, and holding the port, so the
    one started in its place could not bind it and exited."""
    supervisor = multiprocessing.parent_process()  # uvicorn spawns its workers
    if not sys.platform.startswith("linux") or supervisor is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != supervisor.pid:  # it died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def _stopping(stop: Any, signum: int, frame: FrameType | None) -> None:
    from apps.runs.waiting import listener

    # From a thread: this handler may have interrupted one holding the listener's lock.
    threading.Thread(target=listener.close_waits, name="close-long-polls", daemon=True).start()
    stop(signum, frame)


class Command(BaseCommand):
    help = "Serve the API and the dashboard (uvicorn worker processes behind one socket)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=_bounded(0, 65535), default=8000)
        parser.add_argument(
            "--workers", type=_bounded(1, 256), default=1, help="processes (default 1)"
        )
        parser.add_argument(
            "--log-level",
            default="info",
            choices=["critical", "error", "warning", "info", "debug", "trace"],
        )
        parser.add_argument("--no-access-log", action="store_true")

    def handle(self, *, host: str, port: int, workers: int, **options) -> None:
        # The worker processes load the application afresh; this one only supervises them.
        os.environ.setdefault("SCHEDULER_DB_POOL", "true")
        config = uvicorn.Config(
            APPLICATION,
            factory=True,
            # httptools, with each request's head bounded (SCHEDULER_MAX_HEADER_BYTES).
            http=BoundedHeadProtocol,
            timeout_graceful_shutdown=GRACEFUL_STOP_SECONDS,
            host=host,
            port=port,
            workers=max(1, workers),
            lifespan="off",
            # The client address is REMOTE_ADDR: X-Forwarded-For is read by the application,
            # and only with SCHEDULER_BEHIND_PROXY (apps/teams/lockout.py). uvicorn would
            # otherwise believe the header from any peer on 127.0.0.1, and let a caller pick its
            # own address for the /metrics allow-list and the per-address throttles.
            proxy_headers=False,
            log_level=options["log_level"],
            access_log=not options["no_access_log"],
            # uvicorn's own lines (access, start, stop) through the application's logging, so
            # LOG_FORMAT=json is JSON lines throughout; its default config wrote them as text.
            log_config=None,
        )
        # The port before anything else: a second start on a port in use (a deploy run twice)
        # stops here, having touched nothing of the process that holds it.
        sock = listening_socket(config)
        if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Each worker counts apart: /metrics, served by one of them, jumped between their
            # counts from scrape to scrape (read as counter resets). A folder of their own adds
            # them up (a host's scheduler joins only through a folder given to both). Emptied
            # of a previous process's files only by the one that holds the port: emptied before
            # the bind, a start that then failed on the port wiped the running server's counts.
            folder = Path(settings.DATA_DIR) / "prometheus" / f"web-{sock.getsockname()[1]}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
        Multiprocess(config, sockets=[sock]).run()
