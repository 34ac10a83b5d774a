"""The Celery bridge: lease runs for a team's Celery tasks, send them to Celery, report outcomes.

    # myapp/tasks.py
    from celery import Celery
    from cronlease_client.celery import cronlease_task

    app = Celery("myapp", broker="redis://127.0.0.1:6379/0")

    @cronlease_task(app, "billing.export-invoices")
    def export_invoices(ctx):          # ctx: as the SDK's handlers get it, plus ctx.task
        return {"rows": 1234}

    python -m cronlease_client bridge myapp.tasks --queue billing   # leases, sends to Celery
    celery -A myapp.tasks worker                                     # runs the tasks

Needs `pip install "cronlease-client[celery]"`; the rest of the SDK never imports this module, so
plain workers do not need Celery.

One bookkeeping, the scheduler's. Celery only carries the message:
- The bridge leases runs of the jobs that have a task and publishes one message per lease (the
  lease fields, fencing token included, travel in the message). It does not run anything.
- The task, in the Celery worker, first heartbeats with the message's fencing token. A 409 or 404
  means the run was reaped or leased again while the message waited: the function must not run,
  the newer attempt owns the run. Otherwise it runs the function while a thread heartbeats, then
  completes the run or fails it (type, message, retryable) itself.
- Retries are the scheduler's only: `self.retry()` and the autoretry options never publish a new
  Celery message; a retry request is a retryable failure, and the definition's `maxAttempts` and
  backoff decide, with a new lease and a new fencing token per attempt.
- Messages are acknowledged on receipt (never `acks_late`): a Celery worker that dies mid-task
  loses the message, its heartbeats stop, the lease expires and the reaper retries the run. With
  late acks the broker would redeliver it as well, and two systems would retry the same run.

While a message waits in the broker, the bridge heartbeats its lease; when the task starts it
says so with a Celery event (`cronlease-handoff`) and the bridge stops. The other way, a lease
long enough to cover the broker wait, was not taken: heartbeats extend a lease by the length it
was leased for, so a long lease would also be the time a dead Celery worker keeps a run hostage.
Short leases find a dead worker within `lease_seconds`, and the wait in the broker is bounded
separately (`max_queued_seconds`, also the messages' Celery `expires`).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import celery
from celery.exceptions import Retry

from cronlease_client.context import Context
from cronlease_client.errors import ApiError, Retryable
from cronlease_client.transport import Transport, backoff_delay, heartbeat_leases
from cronlease_client.worker import (
    MAX_BATCH,
    SKIPPED_DRY_RUN,
    Report,
    default_worker_id,
    describe_failure,
)

logger = logging.getLogger("cronlease_client")

# The event a task sends when it takes a run over from the bridge (or refuses it). Celery routes
# events by type with "-" as ".", so a bridge subscribes to "cronlease.#" only, not to the task
# events a monitored Celery cluster may be emitting by the thousand.
HANDOFF_EVENT = "cronlease-handoff"
HANDOFF_ROUTING_KEY = "cronlease.#"

# Celery's own retry machinery: accepted so existing tasks move over unchanged, but dropped,
# since the job definition's retry policy is the only one (see the module docstring).
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


class BridgeFailed(RuntimeError):
    """A part of the bridge stopped on an unexpected error (say, the broker was unreachable)."""


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
    if not bridge.get("id"):
        return
    try:
        with task.app.events.default_dispatcher(hostname=task.request.hostname) as dispatcher:
            dispatcher.send(
                HANDOFF_EVENT,
                bridge=bridge["id"],
                runId=lease["runId"],
                fencingToken=lease["fencingToken"],
                outcome=outcome,
            )
    except Exception:
        # Best effort: a bridge that misses it sees a 409 once the run ends, or stops after
        # max_queued_seconds, and the task's own heartbeats keep the lease meanwhile.
        logger.debug("could not send the handoff event run_id=%s", lease["runId"], exc_info=True)


class _LeaseKeeper(threading.Thread):
    """Heartbeat one run while its function runs; set `lost` on a 409/404 and stop."""

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
        self.done = threading.Event()

    def run(self) -> None:
        # Its own connection: the task's thread may be reporting at the same time. `done`
        # cancels a backoff, so a finished task does not keep retrying heartbeats.
        http = Transport(self.url, self.token, attempts=3, cancel=self.done)
        path = f"/api/v1/runs/{self.run_id}/heartbeat"
        try:
            while not self.done.wait(self.interval):
                try:
                    http.post(
                        path,
                        {"fencingToken": self.fencing_token},
                        timeout=max(1.0, min(10.0, self.interval)),
                    )
                except ApiError as exc:
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
        return describe_failure(request), None
    except Exception as exc:
        return describe_failure(exc, ctx.retryable), None
    except BaseException as exc:
        # The worker is being torn down (cold shutdown, SystemExit): report the attempt as a
        # retryable failure now rather than after the lease expires, then let Celery go on.
        return describe_failure(exc), exc
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        # The work is done; failing now would only run it again for nothing.
        ctx.logger.warning("task result is not JSON; storing its repr")
        value = {"unserializable": repr(value)[:1000]}
    return Report("succeeded", value), None


def _report(http: Transport, run_id: str, token: int, report: Report, fields: dict) -> str:
    """Send the outcome; return the run's new state, or "" when it was not accepted."""
    try:
        answer = http.post(
            "/api/v1/results", {"results": [report.item(run_id, token)]}, attempts=10
        )
    except ApiError as exc:
        if exc.status == 413 and report.outcome == "succeeded":
            logger.warning("result too large run_id=%s; completing without it", run_id)
            return _report(
                http, run_id, token, Report("succeeded", {"resultTooLarge": True}), fields
            )
        logger.error(
            "could not report run_id=%s (%s); its lease will expire and the scheduler retry it",
            run_id,
            exc,
            extra=fields,
        )
        return ""
    (item,) = answer.get("results") or [{}]
    if item.get("status") != 200:
        logger.warning(
            "result refused run_id=%s status=%s: %s",
            run_id,
            item.get("status"),
            item.get("detail", "no answer for this run"),
            extra=fields,
        )
        return ""
    return str(item.get("state", ""))


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
    fields = {
        "run_id": run_id,
        "job": lease.get("job"),
        "attempt": lease.get("attempt"),
        "fencing_token": token,
    }
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
        lease, lease_lost=keeper.lost, worker_id=task.request.hostname or default_worker_id()
    )
    ctx.task = task
    try:
        report, interrupted = _call(spec, task, ctx)
    finally:
        keeper.stop()
    if keeper.lost.is_set():
        logger.warning(
            "result not sent run_id=%s outcome=%s: its lease was lost",
            run_id,
            report.outcome,
            extra=fields,
        )
        return {**summary, "outcome": "lease_lost"}
    if report.outcome == "failed":
        logger.warning(
            "run failed run_id=%s job=%s attempt=%s error_type=%s retryable=%s: %s%s",
            run_id,
            spec.job,
            lease.get("attempt"),
            report.error_type,
            report.retryable,
            report.message,
            "\n" + report.traceback.rstrip() if report.traceback else "",
            extra=fields,
        )
    state = _report(http, run_id, token, report, fields)
    if interrupted is not None:
        raise interrupted
    return {**summary, "outcome": report.outcome, "state": state}


# -- the bridge process ----------------------------------------------------------------------


@dataclass
class _Pending:
    """A lease sent to Celery whose task has not started yet: the bridge keeps it alive."""

    run_id: str
    job: str
    attempt: int
    token: int
    sent_at: float  # time.monotonic()

    def fields(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "job": self.job,
            "attempt": self.attempt,
            "fencing_token": self.token,
        }


class Bridge:
    """Lease runs of the jobs that have a Celery task and publish them to Celery.

    At most `prefetch` runs wait in the broker at once (sent, not yet started by a task); a run
    that has started runs in a Celery worker slot, so Celery's concurrency bounds those. `run()`
    blocks; SIGTERM or Ctrl-C stop it gracefully, a second Ctrl-C at once.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        queues: Iterable[str] | str,
        *,
        tasks: Mapping[str, TaskSpec] | None = None,
        prefetch: int = 10,
        lease_seconds: int = 60,
        wait_seconds: int = 20,
        max_queued_seconds: float = 600,
        grace_seconds: float = 30,
        worker_id: str | None = None,
        http_timeout: float = 10.0,
    ) -> None:
        self.queues = [queues] if isinstance(queues, str) else list(queues)
        self.tasks = dict(registered_tasks() if tasks is None else tasks)
        if not self.queues:
            raise ValueError("give at least one queue")
        if not self.tasks:
            raise ValueError("no job has a Celery task (mark functions with @cronlease_task)")
        if not 1 <= prefetch <= MAX_BATCH:
            raise ValueError(f"prefetch must be between 1 and {MAX_BATCH}")
        if lease_seconds < 1 or wait_seconds < 0 or grace_seconds < 0 or max_queued_seconds <= 0:
            raise ValueError(
                "lease_seconds must be >= 1, max_queued_seconds > 0, "
                "wait_seconds and grace_seconds >= 0"
            )
        apps = {id(spec.app): spec.app for spec in self.tasks.values()}
        if len(apps) != 1:
            raise ValueError("the tasks of one bridge must belong to one Celery app")
        (self.app,) = apps.values()
        self.base_url = base_url
        self.token = token
        self.prefetch = prefetch
        self.lease_seconds = lease_seconds
        self.wait_seconds = wait_seconds
        self.max_queued_seconds = max_queued_seconds
        self.grace_seconds = grace_seconds
        self.worker_id = worker_id or default_worker_id()
        self.http_timeout = http_timeout
        self.heartbeat_interval = max(0.2, lease_seconds / 3)
        # Names this process in the handoff events, even when two bridges share a worker id.
        self.instance = uuid.uuid4().hex
        # Set by a fatal answer (401, 403, 400) to a lease request; run() raises it.
        self.error: ApiError | None = None
        # Set when a thread of the bridge crashed; run() raises BridgeFailed.
        self.failure: str | None = None

        self.shutdown = threading.Event()
        self._forced = threading.Event()
        self._stopped = threading.Event()
        self._receiving = threading.Event()
        self._threads_stop = threading.Event()
        self._lease_done = threading.Event()
        self._lock = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._closing = False  # past the grace period: no more messages are sent
        self._receiver: Any = None
        self._threads: dict[str, threading.Thread] = {}
        self._started = False

    @property
    def forced(self) -> bool:
        return self._forced.is_set()

    def pending(self) -> list[str]:
        """The run ids sent to Celery whose task has not started yet."""
        with self._lock:
            return list(self._pending)

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> Bridge:
        """Connect to the broker and start leasing in background threads."""
        if self._started:
            raise RuntimeError("this bridge has already been started")
        self._lease_http = self._transport(cancel=self.shutdown)
        self._started = True
        self._heartbeat_http = self._transport(cancel=self._forced, attempts=3)
        self._spawn("cronlease-bridge-events", self._receive_loop)
        self._spawn("cronlease-bridge-heartbeat", self._heartbeat_loop)
        self._spawn("cronlease-bridge-lease", self._lease_loop)
        self._spawn("cronlease-bridge-supervisor", self._supervise)
        logger.info(
            "bridge started worker_id=%s queues=%s prefetch=%d lease_seconds=%d jobs=%s",
            self.worker_id,
            ",".join(self.queues),
            self.prefetch,
            self.lease_seconds,
            ",".join(sorted(self.tasks)),
        )
        return self

    def run(self) -> None:
        """Start and block until stopped; raise ApiError when the scheduler refused the bridge."""
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, self._on_signal)
        try:
            self.start()
            # Short waits, so the main thread gets back to the interpreter to run signal handlers.
            while not self._stopped.wait(0.2) and not self._forced.is_set():
                pass
        finally:
            for signum, handler in previous.items():
                if handler is not None:
                    signal.signal(signum, handler)
        if self.error is not None:
            raise self.error
        if self.failure is not None:
            raise BridgeFailed(self.failure)

    def stop(self, *, force: bool = False, timeout: float | None = None) -> bool:
        """Stop leasing; wait (up to the grace period) for queued runs to start; wait for the end."""
        if force:
            self._forced.set()
        self.shutdown.set()
        with self._lock:
            self._lock.notify_all()
        if not self._started:
            self._stopped.set()
            return True
        return self._stopped.wait(self.grace_seconds + 30 if timeout is None else timeout)

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self.shutdown.is_set():
            self._forced.set()
        self.shutdown.set()

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads[name] = thread
        thread.start()

    def _transport(self, *, cancel: threading.Event, attempts: int = 5) -> Transport:
        return Transport(
            self.base_url, self.token, timeout=self.http_timeout, attempts=attempts, cancel=cancel
        )

    # -- handoff events ---------------------------------------------------------------------

    def _receive_loop(self) -> None:
        bridge = self
        iterations = [0]

        def on_iteration() -> None:
            # The broker subscription is made by the first drain: from the second iteration
            # on, no handoff event can be missed, and leasing may begin.
            iterations[0] += 1
            if iterations[0] > 1:
                bridge._receiving.set()

        try:
            with self.app.connection_for_read() as connection:
                receiver = self.app.events.Receiver(
                    connection,
                    handlers={HANDOFF_EVENT: self._on_handoff},
                    routing_key=HANDOFF_ROUTING_KEY,
                    node_id=f"cronlease-bridge-{self.instance}",
                )
                # No wake-up broadcast to the workers (Celery's default for event monitors).
                receiver.on_consume_ready = lambda *args, **kwargs: None
                receiver.on_iteration = on_iteration
                self._receiver = receiver
                if self._threads_stop.is_set():
                    return
                # ConsumerMixin.run reconnects after a lost broker connection until should_stop,
                # which it checks between waits of `safety_interval`.
                receiver.run(safety_interval=0.5)
        except Exception as exc:
            logger.exception("the event receiver stopped; stopping the bridge")
            self.failure = f"cannot receive Celery events from the broker: {exc}"
            self.shutdown.set()

    def _on_handoff(self, event: Mapping[str, Any]) -> None:
        if event.get("bridge") != self.instance:
            return
        run_id, outcome = event.get("runId"), event.get("outcome")
        with self._lock:
            pending = self._pending.get(run_id)  # type: ignore[arg-type]
            if pending is None or pending.token != event.get("fencingToken"):
                return  # an older attempt's message, or already dropped
            del self._pending[pending.run_id]
            self._lock.notify_all()
        logger.log(
            logging.DEBUG if outcome == "started" else logging.INFO,
            "handed over run_id=%s job=%s attempt=%s to %s: %s",
            pending.run_id,
            pending.job,
            pending.attempt,
            event.get("hostname"),
            outcome,
            extra=pending.fields(),
        )

    # -- heartbeats -------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._threads_stop.wait(self.heartbeat_interval):
            try:
                self.heartbeat_once()
            except Exception:
                logger.exception("heartbeat round failed")
        self._heartbeat_http.close()

    def heartbeat_once(self) -> None:
        """Extend the leases of runs waiting in the broker; drop those that ended or waited too long.

        A run that waited past `max_queued_seconds` is no longer extended, not failed: its
        message may have been lost (a Celery worker that died holding it), and failing it
        would kill a task that did start but whose handoff event went missing. The lease
        expires and the reaper retries the run; a late message is refused by its first heartbeat.
        """
        now = time.monotonic()
        with self._lock:
            overdue = [
                p for p in self._pending.values() if now - p.sent_at > self.max_queued_seconds
            ]
            for pending in overdue:
                del self._pending[pending.run_id]
            runs = list(self._pending.values())
            if overdue:
                self._lock.notify_all()
        for pending in overdue:
            logger.warning(
                "run_id=%s job=%s attempt=%s not started by Celery within %ss: no longer "
                "extending its lease (the scheduler retries it when it expires)",
                pending.run_id,
                pending.job,
                pending.attempt,
                self.max_queued_seconds,
                extra=pending.fields(),
            )
        lost = heartbeat_leases(
            self._heartbeat_http,
            [(pending.run_id, pending.token) for pending in runs],
            timeout=max(1.0, min(self.http_timeout, self.heartbeat_interval)),
            batch=MAX_BATCH,
        )
        for pending in runs:
            if pending.run_id in lost:
                # Done before its handoff event arrived, or reaped, or cancelled.
                self._drop(pending, lost[pending.run_id])

    def _drop(self, pending: _Pending, detail: str) -> None:
        with self._lock:
            if self._pending.get(pending.run_id) is pending:
                del self._pending[pending.run_id]
                self._lock.notify_all()
        logger.debug(
            "lease ended while queued run_id=%s: %s", pending.run_id, detail, extra=pending.fields()
        )

    # -- leasing ----------------------------------------------------------------------------

    def _room(self) -> int:
        """Block until fewer than `prefetch` runs wait in the broker; return how many more fit."""
        with self._lock:
            while len(self._pending) >= self.prefetch and not self.shutdown.is_set():
                self._lock.wait(0.5)
            return 0 if self.shutdown.is_set() else self.prefetch - len(self._pending)

    def _lease_loop(self) -> None:
        failures = 0
        try:
            # No lease before the handoff events can be heard (and the broker is reachable).
            while not self._receiving.wait(0.2):
                if self.shutdown.is_set():
                    return
            while not self.shutdown.is_set():
                try:
                    self.lease_once()
                except ApiError as exc:
                    if not exc.transient:
                        # 401/403/400 will not get better by asking again.
                        self.error = exc
                        logger.error("the scheduler refused this bridge (%s); stopping", exc)
                        self.shutdown.set()
                        return
                    failures += 1
                    delay = backoff_delay(failures, base=0.5, cap=30.0)
                    logger.warning("leasing failed; retrying in %.1fs: %s", delay, exc)
                    self.shutdown.wait(delay)
                except PublishFailed as exc:
                    failures += 1
                    delay = backoff_delay(failures, base=0.5, cap=30.0)
                    logger.error(
                        "the broker refused messages; leasing again in %.1fs: %s", delay, exc
                    )
                    self.shutdown.wait(delay)
                else:
                    failures = 0
        except Exception as exc:
            logger.exception("lease loop crashed; stopping the bridge")
            self.failure = f"the lease loop crashed: {exc}"
            self.shutdown.set()
        finally:
            self._lease_done.set()
            with self._lock:
                self._lock.notify_all()
            self._lease_http.close()

    def lease_once(self) -> int:
        """Lease as many runs as fit under `prefetch` (long-polling) and send them; return how many."""
        room = self._room()
        if not room:
            return 0
        answer = self._lease_http.post(
            "/api/v1/leases",
            {
                "queues": self.queues,
                # Only the jobs that have a Celery task: the queue may hold others.
                "jobs": sorted(self.tasks),
                "max": room,
                "workerId": self.worker_id,
                "leaseSeconds": self.lease_seconds,
                "waitSeconds": self.wait_seconds,
            },
            timeout=self.wait_seconds + self.http_timeout,
        )
        leases = answer.get("leases", [])
        if not leases and not self.wait_seconds:
            self.shutdown.wait(1.0)  # without a long poll an empty answer comes back at once
        # Leases that arrive after SIGTERM are still ours: they are sent like the others.
        self.dispatch(leases)
        return len(leases)

    def dispatch(self, leases: list[Mapping[str, Any]]) -> None:
        """Send each lease to its task; answer at once the ones that cannot go to Celery."""
        answered: list[tuple[Mapping[str, Any], Report]] = []
        failure: Exception | None = None
        for lease in leases:
            spec = self.tasks.get(lease["job"])
            if spec is None:
                # Only when a definition joined the queues after the startup check.
                logger.error(
                    "leased run_id=%s of job %s, which has no Celery task: failing it as "
                    "retryable (keep jobs without a task out of queues %s)",
                    lease["runId"],
                    lease["job"],
                    ",".join(self.queues),
                )
                answered.append(
                    (
                        lease,
                        Report(
                            "failed",
                            error_type="UnknownJob",
                            message=f"bridge {self.worker_id} has no Celery task for job "
                            f"{lease['job']!r}",
                        ),
                    )
                )
            elif lease.get("dryRun") and not spec.dry_run:
                answered.append((lease, SKIPPED_DRY_RUN))
            elif failure is not None or self._closing:
                # Never reached the broker, so no task can be running it: fail it now.
                reason = "the broker refused the message" if failure else "the bridge stopped"
                answered.append(
                    (lease, Report("failed", error_type="BridgeNotSent", message=reason))
                )
            else:
                try:
                    self._send(spec, lease)
                except Exception as exc:
                    failure = exc
                    answered.append(
                        (
                            lease,
                            Report(
                                "failed",
                                error_type="BridgeNotSent",
                                message=f"the broker refused the message: {exc}",
                            ),
                        )
                    )
        if answered:
            self._answer(answered)
        if failure is not None:
            raise PublishFailed(str(failure)) from failure

    def _send(self, spec: TaskSpec, lease: Mapping[str, Any]) -> None:
        pending = _Pending(
            lease["runId"], lease["job"], lease["attempt"], lease["fencingToken"], time.monotonic()
        )
        # Registered before the publish: a fast task's handoff event must find it.
        with self._lock:
            self._pending[pending.run_id] = pending
        try:
            spec.task.apply_async(
                kwargs={
                    "lease": dict(lease),
                    "bridge": {
                        "id": self.instance,
                        "workerId": self.worker_id,
                        "leaseSeconds": self.lease_seconds,
                    },
                },
                # Readable in Celery's logs and Flower; unique per attempt.
                task_id=f"cronlease-{pending.run_id}-{pending.token}",
                # A message the bridge stopped vouching for is dropped by the Celery worker.
                expires=self.max_queued_seconds,
            )
        except Exception:
            with self._lock:
                self._pending.pop(pending.run_id, None)
                self._lock.notify_all()
            raise
        logger.debug(
            "sent run_id=%s job=%s attempt=%s fencing_token=%s to Celery task %s",
            pending.run_id,
            pending.job,
            pending.attempt,
            pending.token,
            spec.task.name,
            extra=pending.fields(),
        )

    def _answer(self, answered: list[tuple[Mapping[str, Any], Report]]) -> None:
        items = [report.item(lease["runId"], lease["fencingToken"]) for lease, report in answered]
        try:
            self._lease_http.post("/api/v1/results", {"results": items}, attempts=3)
        except ApiError as exc:
            logger.warning(
                "could not answer %d leases (%s); they expire and are retried", len(items), exc
            )

    # -- shutdown ---------------------------------------------------------------------------

    def _supervise(self) -> None:
        self.shutdown.wait()
        try:
            self._shut_down()
        except Exception:
            logger.exception("shutdown failed")
        finally:
            self._stopped.set()

    def _shut_down(self) -> None:
        """Stop leasing, give queued runs the grace period to start, then stop.

        1. The lease loop ends after its current long poll; leases it brings are sent as usual.
        2. Queued runs keep their leases extended until their tasks start, for up to
           `grace_seconds`: a deploy of the bridge does not cost the runs waiting in Celery.
        3. Runs still queued after that are left to expire: their messages stay in the broker and
           a task that starts after the lease is gone is refused by its first heartbeat.
        4. Stop heartbeats and the event receiver.
        """
        with self._lock:
            queued = len(self._pending)
        logger.info(
            "stopping bridge worker_id=%s: no new leases; %d runs queued in Celery, grace %ss",
            self.worker_id,
            queued,
            self.grace_seconds,
        )
        deadline = time.monotonic() + self.grace_seconds
        with self._lock:
            while not self._forced.is_set() and (self._pending or not self._lease_done.is_set()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, 0.1))
            self._closing = True
            left_behind = list(self._pending.values())
            self._pending.clear()
        for pending in left_behind:
            logger.warning(
                "run_id=%s job=%s attempt=%s still queued in Celery after the grace period: "
                "its lease will expire and the scheduler retry it",
                pending.run_id,
                pending.job,
                pending.attempt,
                extra=pending.fields(),
            )
        self._threads_stop.set()
        if self._receiver is not None:
            self._receiver.should_stop = True
        if not self._forced.is_set():
            for name in ("cronlease-bridge-events", "cronlease-bridge-heartbeat"):
                self._threads[name].join(timeout=5)
        logger.info(
            "bridge stopped worker_id=%s left_queued=%d forced=%s",
            self.worker_id,
            len(left_behind),
            self._forced.is_set(),
        )


class PublishFailed(Exception):
    """Celery could not publish a message (the broker is unreachable)."""
