"""Command line: run a worker with the handlers of a module.

    python -m cronlease_client run myapp.handlers --queue billing --concurrency 8

The URL and token come from --url/--token or CRONLEASE_URL/CRONLEASE_TOKEN (prefer the
environment for the token: command lines are visible to every user of the machine).
Exit status: 0 after a graceful stop, 1 when the scheduler refused the worker, 130 after a
second Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from cronlease_client.errors import ApiError
from cronlease_client.registry import load_handlers
from cronlease_client.worker import Worker

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="lease runs and hand them to a module's handlers")
    run.add_argument("module", help="module to import, e.g. myapp.handlers")
    run.add_argument(
        "--queue", "-q", dest="queues", action="append", required=True, help="repeatable"
    )
    run.add_argument("--url", default=os.environ.get("CRONLEASE_URL"), help="$CRONLEASE_URL")
    run.add_argument("--token", default=os.environ.get("CRONLEASE_TOKEN"), help="$CRONLEASE_TOKEN")
    run.add_argument("--concurrency", "-c", type=int, default=4)
    run.add_argument("--pool", choices=["thread", "process"], default="thread")
    run.add_argument("--batch-size", type=int, default=None, help="default: the concurrency")
    run.add_argument("--lease-seconds", type=int, default=60)
    run.add_argument("--wait-seconds", type=int, default=20)
    run.add_argument("--grace-seconds", type=float, default=30)
    run.add_argument("--worker-id", default=None, help="default: host/pid")
    run.add_argument(
        "--log-level",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default=os.environ.get("CRONLEASE_LOG_LEVEL", "INFO").upper(),
    )
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("give --url or set CRONLEASE_URL")
    if not args.token:
        parser.error("give --token or set CRONLEASE_TOKEN")
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    # httpx logs every request at INFO: one line per long poll and heartbeat is noise.
    logging.getLogger("httpx").setLevel(
        logging.DEBUG if args.log_level == "DEBUG" else logging.WARNING
    )
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    # As `python -m` does, so a console-script entry point finds the project's modules too.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        handlers = load_handlers(args.module)
    except ModuleNotFoundError as exc:
        # Only the named module missing is a usage error; an import failing inside it keeps
        # its traceback.
        if exc.name is None or not (args.module + ".").startswith(exc.name + "."):
            raise
        parser.error(f"cannot import {args.module}: {exc}")
    if not handlers:
        parser.error(f"{args.module} registers no handlers (use @cronlease_client.handler)")
    try:
        worker = Worker(
            args.url,
            args.token,
            args.queues,
            handlers=handlers,
            concurrency=args.concurrency,
            pool=args.pool,
            batch_size=args.batch_size,
            lease_seconds=args.lease_seconds,
            wait_seconds=args.wait_seconds,
            worker_id=args.worker_id,
            grace_seconds=args.grace_seconds,
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        worker.run()
    except ApiError as exc:
        logging.getLogger("cronlease_client").error("worker exiting: %s", exc)
        return 1
    return 130 if worker.forced else 0
