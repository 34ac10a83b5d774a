"""The worker: lease runs in batches, run their handlers in a pool, heartbeat, report, stop cleanly.

Threads, each with its own HTTP connection:
- lease loop: long-polls `POST /api/v1/leases` for as many runs as there are free slots (and
  waits while `concurrency` results are still unreported) of the jobs it has handlers for
  (`jobs`), carrying the outcomes that finished since its last request (`results`): one request
  reports and leases; on stop the long poll under way is hung up on;
- slots (`concurrency` of them): run one handler at a time (in the thread, or in a pool process);
- heartbeat: every `heartbeat_interval` extends every held lease in one `POST /api/v1/heartbeats`;
  an item answered 409 or 404 means the run is someone else's now: its context's `lease_lost` is
  set and whatever its handler returns is dropped; a lease that only expired (`/lease-expired`:
  the run not reaped yet) is still the worker's: its handler runs on and what it returns is sent,
  and taken until the reaper takes the run (dropped, the done work was done again), and the
  heartbeats go on asking, to tell the handler once the run is someone else's;
- reporter: sends in `POST /api/v1/results` the outcomes the lease loop will not carry soon (it
  is long-polling or backing off, or no slot is free): a batch closes when full, after a 50 ms
  window, or at once when no other handler is running;
- supervisor: on stop, waits for in-flight handlers up to `grace_seconds`, fails the rest as
  retryable `WorkerShutdown`, flushes the reporter and closes everything.

A run stays in `_inflight` (and keeps being heartbeated) from its lease until the scheduler has
answered its result, so a slow report cannot let the lease expire under it. When the scheduler
leases this worker a newer attempt of a run it still holds (the older lease expired while its
handler ran on), the older attempt moves to `_superseded`: its `lease_lost` is set and its
outcome dropped, and it is no longer heartbeated; a batch names each run once.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from multiprocessing.managers import SyncManager
from typing import Any, Literal, Protocol, cast

from cronlease_client.context import Context, LeaseFlag
from cronlease_client.errors import ApiError
from cronlease_client.lifecycle import Daemon
from cronlease_client.registry import HandlerFunc, HandlerSpec, job_name_problem, spec_for
from cronlease_client.reporting import (
    MAX_BATCH,
    SKIPPED_DRY_RUN,
    Batch,
    LeasedRun,
    Report,
    describe_failure,
    describe_result,
    log_failure,
    read_answers,
    result_items,
    send_results,
)
from cronlease_client.transport import lease_answer

logger = logging.getLogger("cronlease_client")

RESULTS_WINDOW_SECONDS = 0.05
# How long outcomes wait for the lease loop to carry them before the reporter sends them itself
# (the lease loop asks within FILL_WAIT_SECONDS of a slot freeing, so this is a safety bound).
CARRY_WAIT_SECONDS = 0.25
# After a full batch (more work is probably waiting) the next lease call waits up to this long
# for half the slots to free: fewer, fuller requests instead of one per freed slot.
FILL_WAIT_SECONDS = 0.05
SHUTDOWN_ERROR = "WorkerShutdown"
# The error of a lease the worker could not read (a field damaged on its way): retried, the
# handler never having run.
UNREADABLE_LEASE = "UnreadableLease"
# The most job names one lease request may filter on (the scheduler's `jobs` limit).
MAX_JOBS = 1000


def invoke(
    func: HandlerFunc,
    lease: Mapping[str, Any],
    lease_lost: LeaseFlag,
    worker_id: str,
    cancel_flag: LeaseFlag | None = None,
) -> Report:
    """Call a handler on one lease and return its Report; never raise.

    Module-level so the process pool can pickle it.
    """
    try:
        ctx = Context.from_lease(
            lease, lease_lost=lease_lost, worker_id=worker_id, cancel_flag=cancel_flag
        )
    except Exception as exc:  # a lease answer damaged on its way, past the shape check
        # Not the handler's failure (it never ran), which its error had read as: said so.
        return Report(
            "failed",
            error_type=UNREADABLE_LEASE,
            message=f"the worker could not read its lease, and did not run the handler: {exc}",
        )
    try:
        value = func(ctx)
        if inspect.iscoroutine(value):
            # An `async def` handler: run it to its end on an event loop of its own, in this
            # slot thread (or pool process); the slot stays busy meanwhile, as for any handler.
            value = asyncio.run(value)
    except BaseException as exc:  # a handler's sys.exit() must not take a slot thread down
        return describe_failure(exc, ctx.retryable)
    return describe_result(value, lambda: ctx.logger, "handler")


def _init_child(parent_pid: int) -> None:
    """Set up a pool or manager process: deaf to stop signals, gone with its worker."""
    # The worker decides when handlers stop: Ctrl-C or a service manager's SIGTERM sent to the
    # whole process group must not kill these processes before the grace period is over.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    # Deaf to signals, a child would outlive a worker killed with SIGKILL (or by the OOM
    # killer) forever; its handler's result could not be reported anyway.
    def exit_with_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=exit_with_parent, name="cronlease-parent-watch", daemon=True).start()


def _init_pool_process(parent_pid: int, log_level: int) -> None:
    _init_child(parent_pid)
    if log_level:
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
        )


class _Flag(LeaseFlag, Protocol):
    def set(self) -> None: ...


class _LocalFlag:
    """threading.Event's set, is_set and wait, for a handler in a thread of this process; its
    Event is made only when a handler waits. A worker makes two flags a run and few are ever
    waited on: two Events (a Condition, a lock and a deque each) took 4.7 µs against 0.2, and
    with them, the logger made only when needed and the instants parsed once, the worker's CPU
    a run fell from 40 to 24 µs (bench/README.md, "The SDK worker")."""

    __slots__ = ("_set", "_event")
    _making = threading.Lock()

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        # The flag first, the event second; wait() makes its event first and reads the flag
        # second: whichever comes last sees the other's write, and no set is missed.
        self._set = True
        event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        with _LocalFlag._making:
            if self._event is None:
                self._event = threading.Event()
        if self._set:
            self._event.set()
        return self._event.wait(timeout)


def _say_lease(run: _Run, what: str, detail: str) -> None:
    logger.warning(
        "lease %s run_id=%s job=%s attempt=%s fencing_token=%s: %s",
        what,
        run.run_id,
        run.job,
        run.attempt,
        run.token,
        detail,
        extra=run.fields(),
    )


class _Run(LeasedRun):
    """The worker's record of one lease, from the claim until the scheduler answers its result."""

    def __init__(self, lease: Mapping[str, Any], flag: _Flag, cancel_flag: _Flag) -> None:
        super().__init__(lease["runId"], lease["job"], lease["attempt"], lease["fencingToken"])
        self.lease = lease
        self.flag = flag  # the handler's ctx.lease_lost
        self.cancel_flag = cancel_flag  # the handler's ctx.cancelled
        self.lost = False  # the scheduler answered 409/404 to a heartbeat
        self.cancelled = False  # … because the run was cancelled: it still reports
        self.expired = False  # … because its lease expired, not reaped yet: still this worker's
        self.finished = False  # the handler returned; its report is queued
        self.abandoned = False  # failed by the shutdown; the handler's own outcome is dropped

    def set_flag(self) -> None:
        try:
            self.flag.set()
        except Exception:  # a manager proxy whose manager has already gone
            logger.debug("could not set lease_lost run_id=%s", self.run_id, exc_info=True)


class Worker(Daemon):
    """Lease runs of `queues` and run them with handlers registered by job name.

    `run()` blocks (SIGTERM or Ctrl-C stop it gracefully, a second Ctrl-C at once); `start()`
    runs in background threads and `stop()` ends it.
    """

    kind = "worker"

    def __init__(
        self,
        base_url: str,
        token: str,
        queues: Iterable[str] | str,
        *,
        handlers: Mapping[str, HandlerFunc | HandlerSpec] | None = None,
        concurrency: int = 4,
        pool: Literal["thread", "process"] = "thread",
        batch_size: int | None = None,
        lease_seconds: int = 60,
        wait_seconds: int = 20,
        worker_id: str | None = None,
        grace_seconds: float = 30,
        heartbeat_interval: float | None = None,
        http_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            base_url,
            token,
            queues,
            lease_seconds=lease_seconds,
            wait_seconds=wait_seconds,
            worker_id=worker_id,
            grace_seconds=grace_seconds,
            # A third of the lease leaves two more chances before it runs out.
            heartbeat_interval=heartbeat_interval or max(0.2, lease_seconds / 3),
            http_timeout=http_timeout,
        )
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if pool not in ("thread", "process"):
            raise ValueError("pool must be 'thread' or 'process'")
        if lease_seconds < 1 or wait_seconds < 0 or grace_seconds < 0:
            raise ValueError("lease_seconds must be >= 1, wait_seconds and grace_seconds >= 0")
        self.concurrency = concurrency
        self.pool = pool
        self.batch_size = max(1, min(batch_size or concurrency, MAX_BATCH))
        self.handlers: dict[str, HandlerSpec] = {}
        # The `jobs` of every lease request: only runs this worker has a handler for (there is
        # no catch-all handler: any other job's run would fail UnknownJob, using an attempt).
        self._jobs: list[str] | None = None
        for job, func in (handlers or {}).items():
            self.add_handler(job, func)

        self._inflight: dict[str, _Run] = {}  # the newest attempt of each run held
        # Older attempts of runs leased again while their handlers still ran (or their results
        # were on their way), by (run id, fencing token): they hold a slot until they end.
        self._superseded: dict[tuple[str, int], _Run] = {}
        self._busy = 0  # leases handed to the slots whose handler has not returned
        self._abandoning = False
        self._tasks: queue.SimpleQueue[_Run | None] = queue.SimpleQueue()
        # Outcomes not yet sent, oldest first, under `_lock`: the lease loop carries them or
        # the reporter sends them, whichever takes them first.
        self._unsent: list[tuple[_Run, Report]] = []
        self._unsent_since = 0.0  # when the oldest of them finished (monotonic)
        # The lease loop is in a request or a pause (else it carries what is unsent next).
        self._lease_away = False
        self._unsent_closed = False  # no more outcomes: the reporter sends the rest and ends
        self._apart: list[tuple[_Run, Report]] = []  # never carried: the reporter sends them
        self._executor: ProcessPoolExecutor | None = None
        self._manager: SyncManager | None = None

    # -- handlers ---------------------------------------------------------------------------

    def add_handler(
        self, job: str, func: HandlerFunc | HandlerSpec, *, dry_run: bool | None = None
    ) -> None:
        """Register `func` for `job`. `dry_run=True`: call it for dry-run runs too."""
        reason = job_name_problem(job)
        if reason is not None:
            raise ValueError(f"{job!r} cannot be a job's name: {reason}")
        self.handlers[job] = spec_for(job, func, dry_run=dry_run)
        # Past the scheduler's limit on a request's `jobs`, lease every job of the queues.
        self._jobs = sorted(self.handlers) if len(self.handlers) <= MAX_JOBS else None

    def handler(self, job: str, *, dry_run: bool = False) -> Callable[[HandlerFunc], HandlerFunc]:
        """Decorator form of add_handler: `@worker.handler("billing.export-invoices")`."""

        def register(func: HandlerFunc) -> HandlerFunc:
            self.add_handler(job, func, dry_run=dry_run)
            return func

        return register

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> Worker:
        """Start leasing in background threads and return at once."""
        if self._started:
            raise RuntimeError("this worker has already been started")
        if not self.handlers:
            raise ValueError("register at least one handler before starting the worker")
        if self.pool == "process":
            self._check_picklable()
            self._start_process_pool()
        self._started = True
        self._lease_http = self._transport(cancel=self.shutdown)
        self._heartbeat_http = self._transport(cancel=self._forced, attempts=3)
        self._results_http = self._transport(cancel=self._forced, attempts=10)
        self._spawn("cronlease-lease", self._lease_loop)
        self._spawn("cronlease-heartbeat", self._heartbeat_loop)
        self._spawn("cronlease-results", self._report_loop)
        for index in range(self.concurrency):
            self._spawn(f"cronlease-slot-{index}", self._slot_loop)
        self._spawn("cronlease-supervisor", self._supervise)
        logger.info(
            "worker started worker_id=%s queues=%s concurrency=%d pool=%s jobs=%s",
            self.worker_id,
            ",".join(self.queues),
            self.concurrency,
            self.pool,
            ",".join(sorted(self.handlers)),
            extra={"worker_id": self.worker_id, "queues": self.queues},
        )
        return self

    def _check_picklable(self) -> None:
        for job, spec in self.handlers.items():
            try:
                pickle.dumps(spec.func)
            except Exception as exc:
                raise ValueError(
                    f"the handler of {job!r} cannot be sent to a pool process ({exc}); "
                    "define it at module level or use pool='thread'"
                ) from exc

    def _start_process_pool(self) -> None:
        # spawn, not fork: forking a process that runs HTTP threads can copy held locks.
        mp_context = multiprocessing.get_context("spawn")
        self._manager = SyncManager(ctx=mp_context)
        self._manager.start(_init_child, (os.getpid(),))
        package_logger = logging.getLogger("cronlease_client")
        level = package_logger.getEffectiveLevel() if logging.getLogger().handlers else 0
        self._pool_settings = (mp_context, level)
        self._executor = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        mp_context, level = self._pool_settings
        return ProcessPoolExecutor(
            max_workers=self.concurrency,
            mp_context=mp_context,
            initializer=_init_pool_process,
            initargs=(os.getpid(), level),
        )

    def _new_flag(self) -> _Flag:
        if self._manager is not None:
            return self._manager.Event()
        return _LocalFlag()

    # -- leasing ----------------------------------------------------------------------------

    def _free_slots(self, wanted: int = 1) -> tuple[int, list[tuple[_Run, Report]]]:
        """Block until a slot is free (or the worker stops), then up to FILL_WAIT_SECONDS more
        until `wanted` are; return how many are free, and the outcomes to carry."""
        with self._lock:
            while self._free() <= 0 and not self.shutdown.is_set():
                self._lock.wait(0.5)
            deadline = time.monotonic() + FILL_WAIT_SECONDS
            while self._free() < wanted and not self.shutdown.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            if self.shutdown.is_set():
                return 0, []
            carried = self._unsent[:MAX_BATCH]
            del self._unsent[:MAX_BATCH]
            self._lock.notify_all()
            return self._free(), carried

    @contextmanager
    def _away(self) -> Iterator[None]:
        """The lease loop is in a request or a pause: the reporter sends what finishes meanwhile."""
        with self._lock:
            self._lease_away = True
            self._lock.notify_all()
        try:
            yield
        finally:
            with self._lock:
                self._lease_away = False

    def _free(self) -> int:
        """Slots free to lease into; call with the lock held.

        A handler's slot frees when it returns, but its lease stays ours (and heartbeated) until
        its result is reported. Leases beyond `concurrency` unreported ones wait: otherwise a
        scheduler slower to take results than to hand out runs would see this worker lease
        without bound, its memory and heartbeats growing with the unreported pile."""
        running = self.concurrency - self._busy
        unreported = 2 * self.concurrency - len(self._inflight) - len(self._superseded)
        return min(running, unreported)

    def _lease_loop(self) -> None:
        failures = 0
        wanted = 1
        try:
            while not self.shutdown.is_set():
                free, carried = self._free_slots(wanted)
                if not free:
                    continue
                asked = min(free, self.batch_size)
                body: dict[str, Any] = {
                    "queues": self.queues,
                    "max": asked,
                    "workerId": self.worker_id,
                    "leaseSeconds": self.lease_seconds,
                    # Results carried are answered at once, not at the long poll's end: their
                    # runs were heartbeated until then (each refused as not leased, a stale
                    # token in the scheduler's metrics), and a stop meanwhile sent them again.
                    # The next request, without them, waits.
                    "waitSeconds": 0 if carried else self.wait_seconds,
                }
                if self._jobs is not None:
                    body["jobs"] = self._jobs
                if carried:
                    body["results"] = result_items(carried)
                with self._away():
                    try:
                        # An answer not of the lease answer's shape is a BadAnswer: retried as a
                        # 5xx is, here and by _lease_failed.
                        leases, answers = self._lease_http.post(
                            "/api/v1/leases",
                            body,
                            timeout=self.wait_seconds + self.http_timeout,
                            parse=lease_answer,
                        )
                    except ApiError as exc:
                        if carried:
                            # Sent apart by the reporter (this thread must not use its
                            # connection), where a bad item is split from its neighbours and a
                            # failure retried: the lease is then asked again without them.
                            self._send_apart(carried)
                            if exc.status in (400, 413):
                                continue
                        if self.shutdown.is_set():
                            return  # the stop interrupted the request: nothing to retry
                        failures += 1
                        if not self._lease_failed(exc, failures):
                            return
                        continue
                failures = 0
                if carried:
                    _, again = read_answers(carried, answers, retrying=True)
                    self._forget([one for one in carried if one not in again])
                    if again:
                        # Sent again apart, by the reporter: carried, they would keep this
                        # worker's lease requests empty (no lease beside an unsettled report).
                        self._send_apart(again)
                if self.shutdown.is_set():
                    # The answer came after the stop: these runs are not started (they would
                    # likely be cut off by the grace period), but given back at once.
                    if leases:
                        self._refuse(leases)
                    return
                # A full answer means a backlog: fill the next request. Otherwise ask as soon
                # as one slot frees, so a run that falls due later starts at once.
                wanted = (
                    max(1, min(self.batch_size, self.concurrency) // 2)
                    if len(leases) >= asked
                    else 1
                )
                if not leases and not self.wait_seconds:
                    # Without a long poll an empty answer comes back at once: do not spin.
                    with self._away():
                        self.shutdown.wait(1.0)
                refused = [lease for lease in leases if not self._dispatch(lease)]
                if refused:
                    self._refuse(refused)
        except Exception as exc:
            logger.exception("lease loop crashed; stopping the worker")
            self.error = self.error or exc
            self.shutdown.set()
        finally:
            self._lease_done.set()
            with self._lock:
                self._lock.notify_all()
            self._lease_http.close()

    def _dispatch(self, lease: Mapping[str, Any]) -> bool:
        run = _Run(lease, self._new_flag(), self._new_flag())
        with self._lock:
            # A stop that lands while a batch is handed out gives the rest back (a process
            # pool's slots took them up to a second after it).
            if self._abandoning or self.shutdown.is_set():
                return False
            older = self._inflight.get(run.run_id)
            self._inflight[run.run_id] = run
            self._busy += 1
            if older is not None:
                self._supersede(older, run)
        if logger.isEnabledFor(logging.DEBUG):  # per run: skip building the fields
            logger.debug(
                "leased run_id=%s job=%s attempt=%s fencing_token=%s",
                run.run_id,
                run.job,
                run.attempt,
                run.token,
                extra=run.fields(),
            )
        self._tasks.put(run)
        return True

    def _supersede(self, older: _Run, newer: _Run) -> None:
        """`newer` is a later attempt of `older`'s run: the scheduler gave up `older`'s lease
        (it expired) and leased the run again, to this worker. Call with the lock held.

        Keyed by run, the newer attempt replaced the older's entry, and the older's end then
        removed the newer's: its heartbeats stopped, its lease expired in turn, and one web
        outage ran a healthy run up to its `maxAttempts` and left it dead. The older attempt is
        kept apart now; its handler is told (`lease_lost`) and its outcome, which the scheduler
        would refuse as stale, is not sent."""
        older.lost = True
        unsent = any(run is older for run, _ in self._unsent)
        if unsent:
            self._unsent = [item for item in self._unsent if item[0] is not older]
        elif older.finished:
            # Its result is on its way: the scheduler's answer settles it (taken before the new
            # lease, or 409), and releases it from here.
            self._superseded[(older.run_id, older.token)] = older
            return
        else:
            self._superseded[(older.run_id, older.token)] = older
            older.set_flag()
        logger.warning(
            "lease lost run_id=%s job=%s attempt=%s fencing_token=%s: the run was leased again "
            "(attempt %s); %s",
            older.run_id,
            older.job,
            older.attempt,
            older.token,
            newer.attempt,
            "its result is not sent" if unsent else "what its handler returns will not be sent",
            extra=older.fields(),
        )

    def _release(self, run: _Run) -> None:
        """The worker is done with `run`'s lease; call with the lock held."""
        if self._inflight.get(run.run_id) is run:
            del self._inflight[run.run_id]
        else:
            self._superseded.pop((run.run_id, run.token), None)

    def _send_apart(self, batch: list[tuple[_Run, Report]]) -> None:
        """Hand outcomes to the reporter, to send on its own connection."""
        with self._lock:
            self._apart.extend(batch)
            self._lock.notify_all()

    def _refuse(self, leases: list[Mapping[str, Any]]) -> None:
        """Give back leases that arrived once the worker was stopping: fail them as retryable
        (the API has no way to hand a lease back without using its attempt), so another worker
        retries them after their backoff rather than after their lease expires."""
        if self._forced.is_set():
            return
        report = Report(
            "failed",
            error_type=SHUTDOWN_ERROR,
            message=f"worker {self.worker_id} was shutting down when this lease arrived",
        )
        items = [report.item(lease["runId"], lease["fencingToken"]) for lease in leases]
        logger.warning("giving back %d leases that arrived after the stop", len(items))
        # A connection of its own: the lease loop's was interrupted by the stop.
        http = self._transport(cancel=self._forced, attempts=2)
        try:
            http.post("/api/v1/results", {"results": items})
        except ApiError as exc:
            logger.warning("could not give back %d late leases: %s", len(items), exc)
        finally:
            http.close()

    # -- running handlers -------------------------------------------------------------------

    def _slot_loop(self) -> None:
        while (run := self._tasks.get()) is not None:
            if self.shutdown.is_set():
                # Handed to the slots before the stop, not started: given back, not run (it
                # would likely be cut off by the grace period).
                self._finish(run, self._not_started)
                continue
            try:
                report = self._execute(run)
            except BaseException as exc:  # the slot must survive whatever happens
                report = describe_failure(exc)
            self._finish(run, report)

    @property
    def _not_started(self) -> Report:
        return Report(
            "failed",
            error_type=SHUTDOWN_ERROR,
            message=f"worker {self.worker_id} was stopping before this run started",
        )

    def _execute(self, run: _Run) -> Report:
        spec = self.handlers.get(run.job)
        if spec is None:
            # Retryable: during a rolling deploy another worker may know this job.
            return Report(
                "failed",
                error_type="UnknownJob",
                message=f"worker {self.worker_id} has no handler for job {run.job!r}",
            )
        if run.lease.get("dryRun") and not spec.dry_run:
            return SKIPPED_DRY_RUN
        if self._executor is None:
            return invoke(spec.func, run.lease, run.flag, self.worker_id, run.cancel_flag)
        executor = self._executor
        try:
            future = executor.submit(
                invoke, spec.func, run.lease, run.flag, self.worker_id, run.cancel_flag
            )
            return future.result()
        except BrokenProcessPool as exc:
            # A handler's process died (os._exit, a segfault, the OOM killer): every run of
            # that pool fails, and a new pool takes the next ones. Kept, the broken pool failed
            # every later run at once until their attempts were spent.
            self._replace_pool(executor)
            return Report(
                "failed",
                error_type="HandlerProcessDied",
                message=f"a handler process of worker {self.worker_id} died: {exc}",
            )

    def _replace_pool(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is not broken or self.shutdown.is_set():
                return  # another run replaced it already, or the worker is stopping
            logger.error("a handler process died; starting a new process pool")
            self._executor = self._new_pool()
        broken.shutdown(wait=False, cancel_futures=True)

    def _finish(self, run: _Run, report: Report) -> None:
        # One locked step, so the supervisor never sees a returned handler as still running.
        with self._lock:
            self._busy -= 1
            if run.abandoned:
                dropped = "the worker already failed it at shutdown"
            elif run.lost:
                dropped = "its lease was lost"
            else:
                dropped = ""
                run.finished = True
                self._queue_outcome(run, report)
            if dropped:
                self._release(run)
            self._lock.notify_all()
        if dropped:
            logger.warning(
                "result not sent run_id=%s job=%s attempt=%s outcome=%s: %s",
                run.run_id,
                run.job,
                run.attempt,
                report.outcome,
                dropped,
                extra=run.fields(),
            )
        elif report.outcome == "failed":
            log_failure(run, report)

    # -- heartbeats -------------------------------------------------------------------------

    def heartbeat_once(self) -> None:
        """Extend every held lease in one request; mark the ones the scheduler says are gone."""
        # A cancelled run's lease is still extended (the answer keeps saying it is cancelled):
        # a handler that runs on to its end is reported, and holds the run while it runs.
        with self._lock:
            runs = [r for r in self._inflight.values() if not r.lost and not r.abandoned]
        refused = self._extend([(run.run_id, run.token) for run in runs])
        for run in runs:
            if run.run_id not in refused:
                continue
            if refused[run.run_id].cancelled:
                if not run.cancelled:
                    self._mark_cancelled(run)
            elif refused[run.run_id].expired:
                self._mark_expired(run, refused[run.run_id].detail)
            else:
                self._mark_lost(run, refused[run.run_id].detail)

    def _mark_cancelled(self, run: _Run) -> None:
        """The run was cancelled: its handler is told (`ctx.cancelled`, `ctx.heartbeat()`), and
        what it returns is still reported (the run then ends cancelled)."""
        with self._lock:
            run.cancelled = True
        try:
            run.cancel_flag.set()
        except Exception:  # a manager proxy whose manager has already gone
            logger.debug("could not set cancelled run_id=%s", run.run_id, exc_info=True)
        logger.info(
            "run cancelled run_id=%s job=%s attempt=%s: asking its handler to stop",
            run.run_id,
            run.job,
            run.attempt,
            extra=run.fields(),
        )

    def _mark_expired(self, run: _Run, detail: str) -> None:
        """The lease expired, the run not yet reaped: still this worker's. Its handler is not
        told (one that stopped at `lease_lost` returns what would be taken as done), and what
        it returns is sent: the scheduler takes it until the reaper takes the run, and answers
        409 after. The next heartbeats tell when that happened (`_mark_lost`)."""
        with self._lock:
            first = not run.expired
            run.expired = True
            reported = run.finished
        if first and not reported:
            _say_lease(run, "expired", f"{detail}; its result will still be sent")

    def _mark_lost(self, run: _Run, detail: str) -> None:
        with self._lock:
            run.lost = True
            already_reported = run.finished
        run.set_flag()
        if already_reported:
            # The result is queued or on its way; the heartbeat raced it. The server has the
            # final word on that result (it answers 409 if the lease really was gone).
            logger.debug("heartbeat refused after the handler returned run_id=%s", run.run_id)
            return
        _say_lease(run, "lost", detail)

    # -- reporting --------------------------------------------------------------------------

    def _queue_outcome(self, run: _Run, report: Report) -> None:
        """Hold an outcome for the lease loop or the reporter; call with the lock held."""
        if not self._unsent:
            self._unsent_since = time.monotonic()
        self._unsent.append((run, report))
        self._lock.notify_all()

    def _report_wait(self, size: int) -> float:
        """With the lock held: 0 when the reporter should send now, else how long to wait.

        The lease loop carries what is unsent when it is between requests and a slot is free
        (it asks within FILL_WAIT_SECONDS). Otherwise, or after CARRY_WAIT_SECONDS all the
        same, the reporter sends: when the batch is full, after the window, or at once when no
        handler is running (nothing else is coming soon)."""
        if not self._unsent:
            return 0.5
        if self._unsent_closed:
            return 0.0
        waited = time.monotonic() - self._unsent_since
        carries = not self._lease_away and not self._lease_done.is_set()
        if carries and self._free() > 0 and not self.shutdown.is_set():
            return max(0.0, CARRY_WAIT_SECONDS - waited)
        if len(self._unsent) >= size:
            return 0.0
        if self._busy == 0:
            return 0.0
        return max(0.0, RESULTS_WINDOW_SECONDS - waited)

    def _report_loop(self) -> None:
        size = min(max(self.batch_size, self.concurrency), MAX_BATCH)
        while True:
            with self._lock:
                while not self._apart and (
                    (wait := self._report_wait(size)) > 0 or not self._unsent
                ):
                    if self._unsent_closed and not self._unsent:
                        break
                    self._lock.wait(wait or 0.5)
                if self._apart:
                    batch, self._apart = self._apart, []
                elif not self._unsent:
                    break
                else:
                    batch = self._unsent[:size]
                    del self._unsent[:size]
            try:
                self._send_results(batch)
            except Exception:
                logger.exception("reporting %d results failed", len(batch))
                self._forget(batch)
        self._results_http.close()

    def _send_results(self, batch: list[tuple[_Run, Report]]) -> None:
        # A run is forgotten (no longer heartbeated) once the scheduler has answered its result.
        send_results(self._results_http, batch, settled=self._forget, unreachable=self._hold_again)

    def _hold_again(self, batch: Batch) -> None:
        """Outcomes the scheduler could not be reached for, after the transport's tries (about
        20 s): held and sent again, their runs still heartbeated, until the scheduler answers.
        Its answer settles them either way: taken, or 409 once a lease ran out meanwhile. Before,
        they were dropped while their leases still ran, and a web restart ran them twice. At
        shutdown they are dropped: the leases expire and the runs are retried."""
        runs = cast("list[tuple[_Run, Report]]", list(batch))
        with self._lock:
            stopping = self.shutdown.is_set()
            if not stopping:
                for run, report in runs:
                    self._queue_outcome(run, report)
        if stopping:
            logger.error(
                "could not report %d results while stopping; their leases will expire and the "
                "runs be retried",
                len(runs),
            )
            self._forget(batch)
        else:
            logger.warning(
                "could not reach the scheduler to report %d results; sending them again",
                len(runs),
            )

    def _forget(self, batch: Batch) -> None:
        with self._lock:
            for run, _ in batch:
                self._release(cast("_Run", run))
            self._lock.notify_all()

    # -- shutdown ---------------------------------------------------------------------------

    def _shut_down(self) -> None:
        """Wait out the grace period, fail what is left, flush the results, close.

        1. No new lease requests (the lease loop has seen `shutdown`); one already waiting on
           the server is interrupted (the scheduler rolls back a long poll's claim when its
           worker hangs up, or fails the runs as retryable when it had committed and not yet
           answered), and runs of an answer that arrives all the same are given back
           as retryable WorkerShutdown failures, not started.
        2. Wait until every handler has returned and the lease loop has ended, at most
           `grace_seconds` (not at all when forced).
        3. Mark the runs still running abandoned and set their `lease_lost`; unless forced, fail
           them as retryable WorkerShutdown so they are retried without waiting for the reaper.
        4. Let the reporter send what it holds, then stop heartbeats and the pool.
        """
        self._lease_http.interrupt()
        with self._lock:
            running = self._busy
        logger.info(
            "stopping worker_id=%s: no new leases; %d handlers running, grace %ss",
            self.worker_id,
            running,
            self.grace_seconds,
        )
        with self._lock:
            self._wait_for_drain(lambda: bool(self._busy))
            self._abandoning = True
            abandoned = [
                run
                for run in self._inflight.values()
                if not run.finished and not run.abandoned and not run.lost
            ]
            for run in abandoned:
                run.abandoned = True
        shutdown = Report(
            "failed",
            error_type=SHUTDOWN_ERROR,
            message=f"worker {self.worker_id} stopped after a grace period of "
            f"{self.grace_seconds}s with the handler still running",
        )
        for run in abandoned:
            run.set_flag()
            logger.warning(
                "abandoning run_id=%s job=%s attempt=%s: still running after the grace period",
                run.run_id,
                run.job,
                run.attempt,
                extra=run.fields(),
            )
            if not self._forced.is_set():
                with self._lock:
                    self._queue_outcome(run, shutdown)
        with self._lock:
            self._unsent_closed = True
            self._lock.notify_all()
        for _ in range(self.concurrency):
            self._tasks.put(None)
        if not self._forced.is_set():
            self._threads["cronlease-results"].join(timeout=max(5.0, self.http_timeout * 3))
        self._threads_stop.set()
        self._stop_pool(kill=bool(abandoned) or self._forced.is_set())
        logger.info(
            "worker stopped worker_id=%s abandoned=%d forced=%s",
            self.worker_id,
            len(abandoned),
            self._forced.is_set(),
        )

    def _stop_pool(self, *, kill: bool) -> None:
        if self._executor is not None:
            processes = list((getattr(self._executor, "_processes", None) or {}).values())
            self._executor.shutdown(wait=False, cancel_futures=True)
            if kill:
                # A handler past the grace period is not coming back: end its process.
                for process in processes:
                    if process.is_alive():
                        process.kill()
        if self._manager is not None:
            try:
                self._manager.shutdown()
            except Exception:
                logger.debug("manager shutdown failed", exc_info=True)
