"""Tasks: marking functions as the Celery tasks of job names, and what such a task does.

`cronlease_task` registers a function for a job and wraps it in a Celery task; `execute` is that
task's body in the Celery worker: it confirms the lease with the message's fencing token, tells
the bridge it has the run, runs the function while a thread heartbeats, and reports the outcome.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import celery  # type: ignore[import-untyped]
from celery import signals  # type: ignore[import-untyped]
from celery.exceptions import Retry  # type: ignore[import-untyped]

from cronlease_client.context import Context
from cronlease_client.errors import ApiError, Retryable
from cronlease_client.lifecycle import default_worker_id
from cronlease_client.reporting import (
    LeasedRun,
    Report,
    describe_failure,
    describe_result,
    log_failure,
    send_results,
)
from cronlease_client.transport import Transport

logger = logging.getLogger("cronlease_client")

# The event a task sends when it takes a run over from the bridge (or refuses it). Celery routes
# events by type with "-" as ".", so a bridge subscribes to "cronlease.#" only, not to the task
# events a monitored Celery cluster may be emitting by the thousand.
# Tries of one report (about 20 s); one the scheduler could not be reached for is sent again
# while the task still holds the lease (`_report`).
REPORT_ATTEMPTS = 10
HANDOFF_EVENT = "cronlease-handoff"
HANDOFF_ROUTING_KEY = "cronlease.#"
# A Celery worker also says which bridge messages it has received (a message may wait in the
# worker for a free slot, and dies with it), and that it is alive, with each of Celery's own
# heartbeats (every 2 s by default; none under --without-heartbeat), and that it left (its
# waiting messages went back to the broker). A bridge stops extending the leases of the runs a
# worker holds once the worker falls silent: killed, it is noticed within a few heartbeats and
# a lease, not after max_queued_seconds.
RECEIVED_EVENT = "cronlease-received"
ALIVE_EVENT = "cronlease-alive"
LEAVING_EVENT = "cronlease-leaving"
# Which start of the worker process sent them: a worker killed and started again under the same
# name (a supervisor's restart, within Celery's heartbeats) was taken for the one that held the
# messages, so their runs stayed leased, and unrun, for max_queued_seconds. A process id is not
# enough: a container's worker has the same one after every restart.
WORKER_START = uuid.uuid4().hex

# Celery's own retry machinery: accepted so existing tasks move over unchanged, but dropped,
# since the job definition's retry policy is the only one (see cronlease_client.celery).
CELERY_RETRY_OPTIONS = frozenset(
    {
        "autoretry_for",
        "dont_autoretry_for",
        "retry_kwargs",
        "retry_backoff",
        "retry_backoff_max",
        "retry_jitter",
        "max_retries",
        "default_retry_delay",
    }
)


class BridgeConfigError(ValueError):
    """The bridge cannot run as configured (say, its queues hold jobs it has no task for)."""


class CeleryRetryRequested(Retryable):
    """A task asked Celery to retry it: a retryable failure, retried by the scheduler instead."""


@dataclass
class CeleryContext(Context):
    """The SDK's Context, plus `task`: the bound Celery task (`ctx.task.request.hostname`, …)."""

    task: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class TaskSpec:
    """A function marked for a job, and the Celery task that runs it."""

    job: str
    func: Callable[..., Any]
    task: Any  # celery.Task (a lazy proxy until the app is finalized)
    app: celery.Celery
    dry_run: bool = False
    bind: bool = False


_registry: dict[str, TaskSpec] = {}


def registered_tasks() -> dict[str, TaskSpec]:
    """Return a copy of the tasks marked with `@cronlease_task` so far, by job name."""
    return dict(_registry)


def load_tasks(module_name: str) -> dict[str, TaskSpec]:
    """Import `module_name` (a tasks module or the Celery app's) and return the marked tasks.

    A Celery app defined in the module also imports its `include`/`imports` modules, as its worker
    does, so `bridge myapp.celery` finds the tasks that `celery -A myapp.celery worker` runs.
    """
    module = importlib.import_module(module_name)
    for value in list(vars(module).values()):
        if isinstance(value, celery.Celery):
            value.loader.import_default_modules()
    return registered_tasks()


class _NoCeleryRetry:
    """Mixed into the task class: a retry request fails the attempt instead of republishing."""

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: Any = None,
        max_retries: Any = None,
        **options: Any,
    ) -> NoReturn:
        # Celery's retry() publishes a copy of the message, which would run the function again
        # outside the scheduler's attempt count, with a fencing token the scheduler has already
        # moved past. Raising here ends the attempt as a retryable failure; `countdown`/`eta` give
        # way to the definition's backoff. (Raised even with throw=False: nothing was scheduled.)
        if exc is None:
            raise CeleryRetryRequested("the task asked Celery to retry it", error_type="Retry")
        raise CeleryRetryRequested(str(exc) or type(exc).__name__) from exc


def cronlease_task(
    app: celery.Celery,
    job: str,
    *,
    dry_run: bool = False,
    bind: bool = False,
    **options: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark the decorated function as the handler of `job`, run as a Celery task of `app`.

    The function takes the run's context (`bind=True`: the task, then the context) and returns a
    JSON-able result, as an SDK handler does; raise Retryable/NonRetryable to choose, any other
    exception is retried by the scheduler. `dry_run=True` opts in to dry-run runs (otherwise the
    bridge completes them as skipped without sending them). Other keyword arguments are Celery
    task options (`name`, `queue`, `time_limit`, …); the function is returned unchanged, with the
    Celery task as its `task` attribute.
    """
    if options.get("acks_late") or options.get("reject_on_worker_lost"):
        raise ValueError(
            "cronlease tasks are acknowledged on receipt: a lost Celery worker is recovered by "
            "the scheduler's lease expiry, and a redelivered message would be a second retry"
        )
    task_options = {key: value for key, value in options.items() if key not in CELERY_RETRY_OPTIONS}
    base = task_options.pop("base", None) or app.Task

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        existing = _registry.get(job)
        if existing is not None and not _same_function(existing.func, func):
            raise ValueError(
                f"job {job!r} already has a Celery task: "
                f"{existing.func.__module__}.{existing.func.__qualname__}"
            )
        holder: dict[str, TaskSpec] = {}

        def run(self: celery.Task, lease: dict[str, Any], bridge: dict[str, Any] | None = None):
            return execute(self, holder["spec"], lease, bridge or {})

        # The task is named after the function (as @app.task names it), so task_routes and logs
        # read as usual; functools.wraps is not used because Celery checks the message's
        # arguments against the signature, and the message carries (lease, bridge), not ctx.
        run.__name__ = func.__name__
        run.__qualname__ = func.__qualname__
        run.__module__ = func.__module__
        run.__doc__ = func.__doc__
        task = app.task(
            bind=True,
            base=type(f"Cronlease{base.__name__}", (_NoCeleryRetry, base), {}),
            **{
                "name": app.gen_task_name(func.__name__, func.__module__),
                # Who ran what is in the scheduler; a result backend write per run is waste.
                "ignore_result": True,
                **task_options,
                "acks_late": False,
                "reject_on_worker_lost": False,
                "max_retries": 0,
            },
        )(run)
        spec = TaskSpec(job, func, task, app, dry_run, bind)
        holder["spec"] = spec
        _registry[job] = spec
        func.task = task  # type: ignore[attr-defined]
        return func

    return register


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    # A reloaded module defines new function objects under the same names: not a conflict.
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


# -- the task side (runs in the Celery worker) ------------------------------------------------


def credentials(app: celery.Celery) -> tuple[str, str]:
    """The scheduler's URL and a worker-scope token: app config first, then the environment."""
    url = app.conf.get("cronlease_url") or os.environ.get("CRONLEASE_URL")
    token = app.conf.get("cronlease_token") or os.environ.get("CRONLEASE_TOKEN")
    if not url or not token:
        raise BridgeConfigError(
            "set CRONLEASE_URL and CRONLEASE_TOKEN (or app.conf.cronlease_url and "
            "app.conf.cronlease_token) in the Celery worker's environment"
        )
    return url, token


_local = threading.local()


def _transport(app: celery.Celery) -> Transport:
    """One Transport per thread and process of the Celery worker, reused across tasks."""
    url, token = credentials(app)
    key = (os.getpid(), url, token)
    cached = getattr(_local, "transport", None)
    if cached is None or cached[0] != key:
        # After a fork (prefork pool) the parent's client is left alone, not closed: its
        # sockets are the parent's too.
        _local.transport = (key, Transport(url, token))
    return _local.transport[1]


def _announce(
    task: celery.Task, bridge: Mapping[str, Any], lease: Mapping[str, Any], outcome: str
) -> None:
    """Tell the bridge that sent this message that it can stop heartbeating the lease."""
    _tell_bridge(task.app, task.request.hostname, bridge, lease, outcome)


def _tell_bridge(
    app: celery.Celery,
    hostname: str | None,
    bridge: Mapping[str, Any],
    lease: Mapping[str, Any],
    outcome: str,
) -> None:
    if not bridge.get("id"):
        return
    # Best effort: a bridge that misses it sees a 409 once the run ends, or stops after
    # max_queued_seconds, and the task's own heartbeats keep the lease meanwhile.
    _send_event(
        app,
        hostname,
        HANDOFF_EVENT,
        bridge=bridge["id"],
        runId=lease["runId"],
        fencingToken=lease["fencingToken"],
        outcome=outcome,
    )


def _send_event(app: celery.Celery, hostname: str | None, event: str, **fields: Any) -> None:
    """Send an event to the bridges, best effort (what each event's loss costs is said where
    it is sent)."""
    try:
        with app.events.default_dispatcher(hostname=hostname) as dispatcher:
            dispatcher.send(event, **fields)
    except Exception:
        logger.debug("could not send the %s event", event, exc_info=True)


@signals.task_received.connect
def announce_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Tell the bridge that this worker holds its message (it may wait here for a free slot).
    Lost, the bridge does not know the holder: it extends the lease until the task starts, or
    for max_queued_seconds."""
    try:
        kwargs = request.kwargs
        lease, bridge = kwargs["lease"], kwargs.get("bridge") or {}
        run_id, token = lease["runId"], lease["fencingToken"]
    except Exception:  # noqa: BLE001 - not a bridge's message (another app's task)
        return
    if bridge.get("id"):
        _send_event(
            sender.app,
            request.hostname,
            RECEIVED_EVENT,
            bridge=bridge["id"],
            runId=run_id,
            fencingToken=token,
            workerStart=WORKER_START,
        )


@signals.heartbeat_sent.connect
def announce_alive(sender: Any = None, **_: Any) -> None:
    """With each of Celery's worker heartbeats (`sender` is celery.worker.heartbeat.Heart).
    Lost now and then, it costs nothing: a bridge waits several heartbeats."""
    eventer = sender.eventer
    _send_event(
        eventer.app,
        eventer.hostname,
        ALIVE_EVENT,
        interval=sender.interval,
        workerStart=WORKER_START,
    )


@signals.worker_shutdown.connect
def announce_leaving(sender: Any = None, **_: Any) -> None:
    """A worker that stops cleanly gives its waiting messages back to the broker, where
    another worker takes them: the bridges keep extending their leases meanwhile."""
    _send_event(sender.app, sender.hostname, LEAVING_EVENT, workerStart=WORKER_START)


@signals.task_unknown.connect
def fail_unknown_task(sender: Any = None, message: Any = None, name: str = "", **_: Any) -> None:
    """A bridge's message for a task this Celery worker does not have (the bridge was deployed
    ahead of it, or routes to the wrong workers): Celery drops it, and its run stayed leased,
    heartbeated by the bridge for `max_queued_seconds` (600 s) per attempt. Its run is failed
    at once as retryable (`TaskNotRegistered`), and the bridge told to let it go."""
    try:
        _, kwargs, _ = message.decode()
        lease, bridge = kwargs["lease"], kwargs.get("bridge") or {}
        run = LeasedRun(
            lease["runId"], lease.get("job") or "", lease.get("attempt") or 0, lease["fencingToken"]
        )
    except Exception:  # noqa: BLE001 - not a bridge's message (another app's task)
        return
    hostname = getattr(sender, "hostname", None)
    _tell_bridge(sender.app, hostname, bridge, lease, "not_registered")
    report = Report(
        "failed",
        error_type="TaskNotRegistered",
        message=f"the Celery worker {hostname or '?'} has no task {name!r}",
    )
    try:
        send_results(_transport(sender.app), [(run, report)], attempts=3)
    except BridgeConfigError:
        logger.error("could not fail run_id=%s: no scheduler configured", run.run_id)


class _LeaseKeeper(threading.Thread):
    """Heartbeat one run while its function runs; on a 409/404 stop, setting `cancelled` when
    the run was cancelled (the function is told, and its outcome is still reported: the run
    then ends cancelled) and `lost` otherwise (its outcome is dropped). A lease that only
    expired (the run not reaped yet) is still the task's: its outcome is sent, and taken until
    the reaper takes the run; the heartbeats go on, and set `lost` once it has."""

    def __init__(
        self, app: celery.Celery, run_id: str, token: int, interval: float, fields: dict[str, Any]
    ) -> None:
        super().__init__(name=f"cronlease-heartbeat-{run_id}", daemon=True)
        self.url, self.token = credentials(app)
        self.run_id = run_id
        self.fencing_token = token
        self.interval = interval
        self.fields = fields
        self.lost = threading.Event()
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.extended_at = time.monotonic()  # the last heartbeat the scheduler took

    def run(self) -> None:
        # Its own connection: the task's thread may be reporting at the same time. `done`
        # cancels a backoff, so a finished task does not keep retrying heartbeats.
        http = Transport(self.url, self.token, attempts=3, cancel=self.done)
        path = f"/api/v1/runs/{self.run_id}/heartbeat"
        expired = False
        try:
            while not self.done.wait(self.interval):
                try:
                    http.post(
                        path,
                        {"fencingToken": self.fencing_token},
                        timeout=max(1.0, min(10.0, self.interval)),
                    )
                    self.extended_at = time.monotonic()
                except ApiError as exc:
                    if exc.status == 409 and exc.type.endswith("/cancelled"):
                        # The lease is still extended (each answer says it is cancelled): a
                        # function that runs on to its end is reported, the run ending cancelled.
                        if not self.cancelled.is_set():
                            self.cancelled.set()
                            logger.info(
                                "run cancelled run_id=%s: asking its task to stop",
                                self.run_id,
                                extra=self.fields,
                            )
                        continue
                    if exc.status == 409 and exc.type.endswith("/lease-expired"):
                        if not expired:
                            logger.warning(
                                "lease expired run_id=%s fencing_token=%s: %s; its result "
                                "will still be sent",
                                self.run_id,
                                self.fencing_token,
                                exc.detail,
                                extra=self.fields,
                            )
                        expired = True
                        continue
                    if exc.status in (404, 409):
                        self.lost.set()
                        logger.warning(
                            "lease lost run_id=%s fencing_token=%s: %s",
                            self.run_id,
                            self.fencing_token,
                            exc.detail,
                            extra=self.fields,
                        )
                        return
                    # Two more rounds before the lease runs out.
                    logger.warning("heartbeat failed run_id=%s: %s", self.run_id, exc)
        finally:
            http.close()

    def stop(self) -> None:
        self.done.set()


def _call(
    spec: TaskSpec, task: celery.Task, ctx: CeleryContext
) -> tuple[Report, BaseException | None]:
    """Run the function; return its Report and, when it was interrupted, what interrupted it."""
    try:
        value = spec.func(task, ctx) if spec.bind else spec.func(ctx)
    except Retry as exc:
        # A Retry raised by hand rather than through task.retry(): a retry request all the same.
        cause = exc.exc if isinstance(exc.exc, BaseException) else None
        request = CeleryRetryRequested(
            str(cause) if cause is not None else "the task raised Retry",
            error_type=type(cause).__name__ if cause is not None else "Retry",
        )
        # The stack the scheduler keeps is the task's: the cause's traceback, or the Retry's.
        request.__cause__ = cause if cause is not None else exc
        return describe_failure(request), None
    except Exception as exc:
        return describe_failure(exc, ctx.retryable), None
    except BaseException as exc:
        # The worker is being torn down (cold shutdown, SystemExit): report the attempt as a
        # retryable failure now rather than after the lease expires, then let Celery go on.
        return describe_failure(exc), exc
    return describe_result(value, lambda: ctx.logger, "task"), None


def execute(
    task: celery.Task, spec: TaskSpec, lease: Mapping[str, Any], bridge: Mapping[str, Any]
) -> dict[str, Any]:
    """The Celery task's body: confirm the lease, run the function with heartbeats, report.

    1. Heartbeat with the message's fencing token. 409/404: the run was reaped or leased again
       while the message waited, so the function does not run. A scheduler that cannot be
       reached: it does not run either, since its outcome could not be reported; the lease
       expires and the scheduler retries the run.
    2. Tell the bridge the task has the run (it stops heartbeating it).
    3. Run the function while a thread heartbeats every third of the lease.
    4. Complete or fail the run with the fencing token; a lease lost meanwhile drops the outcome.
    Returns a summary for Celery's log. Never raises for the function's errors: they belong to
    the scheduler, and an exception reaching Celery would start Celery's own failure handling.
    """
    run_id, token = lease["runId"], lease["fencingToken"]
    run = LeasedRun(run_id, lease.get("job") or "", lease.get("attempt") or 0, token)
    fields = run.fields()
    summary: dict[str, Any] = {
        "runId": run_id,
        "attempt": lease.get("attempt"),
        "fencingToken": token,
    }
    try:
        http = _transport(task.app)
        http.post(f"/api/v1/runs/{run_id}/heartbeat", {"fencingToken": token})
    except (ApiError, BridgeConfigError) as exc:
        lost = isinstance(exc, ApiError) and exc.status in (404, 409)
        _announce(task, bridge, lease, "lease_lost" if lost else "not_confirmed")
        if lost:
            logger.warning(
                "lease lost before the task started run_id=%s fencing_token=%s: not running (%s)",
                run_id,
                token,
                exc,
                extra=fields,
            )
            return {**summary, "outcome": "lease_lost"}
        logger.error(
            "could not confirm the lease run_id=%s (%s): not running; the lease will expire "
            "and the scheduler retry the run",
            run_id,
            exc,
            extra=fields,
        )
        return {**summary, "outcome": "not_confirmed"}
    _announce(task, bridge, lease, "started")

    lease_seconds = float(bridge.get("leaseSeconds") or 60)
    keeper = _LeaseKeeper(task.app, run_id, token, max(0.2, lease_seconds / 3), fields)
    keeper.start()
    ctx = CeleryContext.from_lease(
        lease,
        lease_lost=keeper.lost,
        worker_id=task.request.hostname or default_worker_id(),
        cancel_flag=keeper.cancelled,
    )
    ctx.task = task
    try:
        report, interrupted = _call(spec, task, ctx)
        if keeper.lost.is_set():
            logger.warning(
                "result not sent run_id=%s outcome=%s: its lease was lost",
                run_id,
                report.outcome,
                extra=fields,
            )
            return {**summary, "outcome": "lease_lost"}
        if report.outcome == "failed":
            log_failure(run, report)
        state = _report(http, run, report, keeper, lease_seconds)
    finally:
        keeper.stop()
    if interrupted is not None:
        raise interrupted
    return {**summary, "outcome": report.outcome, "state": state}


def _report(
    http: Transport, run: LeasedRun, report: Report, keeper: _LeaseKeeper, lease_seconds: float
) -> str:
    """Send the outcome; the run's new state, or "" when it was not taken.

    One the scheduler could not be reached for (after REPORT_ATTEMPTS tries, about 20 s) is
    sent again, its lease still heartbeated, until the scheduler answers or a lease's length
    has passed since it last took a heartbeat (it has then reaped the run). Dropped, a web
    restart of half a minute ran the finished task a second time."""
    while True:
        unreachable: list[Any] = []
        state = send_results(
            http, [(run, report)], attempts=REPORT_ATTEMPTS, unreachable=unreachable.extend
        ).get(run.run_id, "")
        held_for = time.monotonic() - keeper.extended_at
        if not unreachable or keeper.lost.is_set() or held_for >= lease_seconds:
            return state
        logger.warning(
            "could not reach the scheduler to report run_id=%s; sending it again",
            run.run_id,
            extra=run.fields(),
        )
