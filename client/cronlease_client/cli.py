"""Command line: run a worker with the handlers of a module, or a bridge to Celery tasks.

    python -m cronlease_client run myapp.handlers --queue billing --concurrency 8
    python -m cronlease_client bridge myapp.tasks --queue billing --prefetch 16

The URL and token come from --url/--token or CRONLEASE_URL/CRONLEASE_TOKEN (prefer the
environment for the token: command lines are visible to every user of the machine).
Exit status: 0 after a graceful stop, 1 when the scheduler refused the worker (or the bridge
failed), 2 for a usage or configuration error, 130 after a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from cronlease_client.errors import ApiError
from cronlease_client.registry import load_handlers
from cronlease_client.worker import Worker

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def _common_options(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--queue", "-q", dest="queues", action="append", required=True, help="repeatable"
    )
    command.add_argument("--url", default=os.environ.get("CRONLEASE_URL"), help="$CRONLEASE_URL")
    command.add_argument(
        "--token", default=os.environ.get("CRONLEASE_TOKEN"), help="$CRONLEASE_TOKEN"
    )
    command.add_argument("--lease-seconds", type=int, default=60)
    command.add_argument("--wait-seconds", type=int, default=20)
    command.add_argument("--grace-seconds", type=float, default=30)
    command.add_argument("--worker-id", default=None, help="default: host/pid")
    command.add_argument(
        "--log-level",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default=os.environ.get("CRONLEASE_LOG_LEVEL", "INFO").upper(),
    )


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="lease runs and hand them to a module's handlers")
    run.add_argument("module", help="module to import, e.g. myapp.handlers")
    _common_options(run)
    run.add_argument("--concurrency", "-c", type=int, default=4)
    run.add_argument("--pool", choices=["thread", "process"], default="thread")
    run.add_argument("--batch-size", type=int, default=None, help="default: the concurrency")

    bridge = commands.add_parser(
        "bridge",
        help="lease runs of the jobs marked with @cronlease_task and send them to Celery",
        description="Needs Celery: pip install 'cronlease-client[celery]'.",
    )
    bridge.add_argument(
        "module", help="module with the @cronlease_task functions or their Celery app"
    )
    _common_options(bridge)
    bridge.add_argument(
        "--prefetch",
        type=int,
        default=10,
        help="most runs waiting in the broker at once (about the Celery workers' concurrency)",
    )
    bridge.add_argument(
        "--max-queued-seconds",
        type=float,
        default=600,
        help="stop extending the lease of a run Celery has not started after this long",
    )
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT)
    # httpx (under a handler's own producer Client) logs every request at INFO: noise at this
    # rate. The worker's own requests are logged at DEBUG (transport.py).
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def _import_error(module: str, exc: ModuleNotFoundError) -> bool:
    """Whether `exc` says the named module itself is missing (a usage error)."""
    return exc.name is not None and (module + ".").startswith(exc.name + ".")


def _exit_before_start(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    previous = None
    if threading.current_thread() is threading.main_thread():
        # A SIGTERM before the worker or bridge takes over its signals (while the handlers'
        # module imports, say) finds nothing leased: exit 0 at once, not killed by it (-15).
        previous = signal.signal(signal.SIGTERM, _exit_before_start)
    try:
        return _main(argv, prog)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None, prog: str | None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("give --url or set CRONLEASE_URL")
    if not args.token:
        parser.error("give --token or set CRONLEASE_TOKEN")
    _configure_logging(args.log_level)
    # As `python -m` does, so a console-script entry point finds the project's modules too.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if args.command == "bridge":
        return _bridge(parser, args)
    try:
        handlers = load_handlers(args.module)
    except ModuleNotFoundError as exc:
        # Only the named module missing is a usage error; an import failing inside it keeps
        # its traceback.
        if not _import_error(args.module, exc):
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
    except Exception as exc:  # a refusal (ApiError) or a crash, logged where it happened
        logging.getLogger("cronlease_client").error("worker exiting: %s", exc)
        return 1
    return 130 if worker.forced else 0


def _bridge(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    # Imported here only: the worker SDK must not need Celery.
    try:
        from cronlease_client import celery as bridging
    except ModuleNotFoundError as exc:
        if exc.name not in ("celery", "kombu"):
            raise
        parser.error("the bridge needs Celery: pip install 'cronlease-client[celery]'")
    try:
        tasks = bridging.load_tasks(args.module)
    except ModuleNotFoundError as exc:
        if not _import_error(args.module, exc):
            raise
        parser.error(f"cannot import {args.module}: {exc}")
    if not tasks:
        parser.error(f"{args.module} marks no tasks (use @cronlease_client.celery.cronlease_task)")
    try:
        bridge = bridging.Bridge(
            args.url,
            args.token,
            args.queues,
            tasks=tasks,
            prefetch=args.prefetch,
            lease_seconds=args.lease_seconds,
            wait_seconds=args.wait_seconds,
            max_queued_seconds=args.max_queued_seconds,
            grace_seconds=args.grace_seconds,
            worker_id=args.worker_id,
        )
    except ValueError as exc:
        parser.error(str(exc))
    log = logging.getLogger("cronlease_client")
    try:
        bridge.run()
    except bridging.BridgeConfigError as exc:
        log.error("bridge not started: %s", exc)
        return 2
    except (ApiError, bridging.BridgeFailed) as exc:
        log.error("bridge exiting: %s", exc)
        return 1
    return 130 if bridge.forced else 0
