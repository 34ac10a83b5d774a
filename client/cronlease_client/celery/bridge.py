"""The bridge process: lease the runs of jobs that have a Celery task and publish them to Celery.

It runs nothing itself. While a message waits in the broker, the bridge heartbeats its lease;
when the task starts it says so with a Celery event (`cronlease-handoff`) and the bridge stops.
The other way, a lease long enough to cover the broker wait, was not taken: heartbeats extend a
lease by the length it was leased for, so a long lease would also be the time a dead Celery
worker keeps a run hostage. Short leases find a dead worker within `lease_seconds`, and the wait
in the broker is bounded separately (`max_queued_seconds`, also the messages' Celery `expires`).
A message a Celery worker received but has not started dies with the worker: the workers say
which they hold and that they are alive (with Celery's worker heartbeats), and the bridge stops
extending the leases a silent worker holds.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cronlease_client.celery.tasks import (
    ALIVE_EVENT,
    HANDOFF_EVENT,
    HANDOFF_ROUTING_KEY,
    LEAVING_EVENT,
    RECEIVED_EVENT,
    TaskSpec,
    registered_tasks,
)
from cronlease_client.errors import ApiError
from cronlease_client.lifecycle import Daemon
from cronlease_client.reporting import (
    MAX_BATCH,
    SKIPPED_DRY_RUN,
    LeasedRun,
    Report,
    read_answers,
)
from cronlease_client.transport import backoff_delay, lease_answer

logger = logging.getLogger("cronlease_client")


# A Celery worker that has sent no heartbeat for this many of its intervals (2 s by default:
# 6 s) is taken for dead, as Celery's own monitors take one after two; at least this long.
SILENT_BEATS = 3
SILENT_MIN_SECONDS = 5.0


class BridgeFailed(RuntimeError):
    """A part of the bridge stopped on an unexpected error (say, the broker was unreachable)."""


class PublishFailed(Exception):
    """Celery could not publish a message (the broker is unreachable)."""


@dataclass
class _Pending(LeasedRun):
    """A lease sent to Celery whose task has not started yet: the bridge keeps it alive."""

    sent_at: float  # time.monotonic()
    holder: str = ""  # the Celery worker that received its message, once it has said so
    holder_start: str = ""  # which start of that worker's process (its `workerStart`)


def _leased(lease: Mapping[str, Any]) -> LeasedRun:
    return LeasedRun(lease["runId"], lease["job"], lease["attempt"], lease["fencingToken"])


class Bridge(Daemon):
    """Lease runs of the jobs that have a Celery task and publish them to Celery.

    At most `prefetch` runs wait in the broker at once (sent, not yet started by a task); a run
    that has started runs in a Celery worker slot, so Celery's concurrency bounds those. `run()`
    blocks; SIGTERM or Ctrl-C stop it gracefully, a second Ctrl-C at once.
    """

    kind = "bridge"
    # Its runs' messages are in the broker, their leases left to expire: nothing to wait for.
    returns_when_forced = True

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
        super().__init__(
            base_url,
            token,
            queues,
            lease_seconds=lease_seconds,
            wait_seconds=wait_seconds,
            worker_id=worker_id,
            grace_seconds=grace_seconds,
            heartbeat_interval=max(0.2, lease_seconds / 3),
            http_timeout=http_timeout,
        )
        self.tasks = dict(registered_tasks() if tasks is None else tasks)
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
        self.prefetch = prefetch
        self.max_queued_seconds = max_queued_seconds
        # Names this process in the handoff events, even when two bridges share a worker id.
        self.instance = uuid.uuid4().hex
        # Set when a thread of the bridge crashed; run() raises BridgeFailed.
        self.failure: str | None = None

        self._receiving = threading.Event()
        self._pending: dict[str, _Pending] = {}
        self._closing = False  # past the grace period: no more messages are sent
        # Leases answered without Celery (a dry run skipped, a job without a task), carried by
        # the next lease request; the lease loop's alone.
        self._unanswered: list[tuple[Mapping[str, Any], Report]] = []
        self._receiver: Any = None
        # Celery workers heard to send heartbeats: hostname → (last heard, their interval, the
        # start of the process heard), by time.monotonic(). Only those are judged: one under
        # --without-heartbeat never is.
        self._heard: dict[str, tuple[float, float, str]] = {}
        self._listening_since: float | None = None  # the event subscription's last (re)start

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
        """Start and block until stopped; raise ApiError when the scheduler refused the bridge,
        BridgeFailed when a part of it stopped on an unexpected error."""
        super().run()
        if self.failure is not None:
            raise BridgeFailed(self.failure)

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
                    handlers={
                        HANDOFF_EVENT: self._on_handoff,
                        RECEIVED_EVENT: self._on_received,
                        ALIVE_EVENT: self._on_alive,
                        LEAVING_EVENT: self._on_leaving,
                    },
                    routing_key=HANDOFF_ROUTING_KEY,
                    node_id=f"cronlease-bridge-{self.instance}",
                )
                # No wake-up broadcast to the workers (Celery's default for event monitors);
                # the time, since a worker's silence counts only while the bridge listens.
                receiver.on_consume_ready = self._on_listening
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

    def _on_listening(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self._listening_since = time.monotonic()

    def _on_received(self, event: Mapping[str, Any]) -> None:
        if event.get("bridge") != self.instance:
            return
        with self._lock:
            pending = self._pending.get(event.get("runId"))  # type: ignore[arg-type]
            if pending is not None and pending.token == event.get("fencingToken"):
                pending.holder = str(event.get("hostname") or "")
                pending.holder_start = str(event.get("workerStart") or "")

    def _on_alive(self, event: Mapping[str, Any]) -> None:
        hostname = str(event.get("hostname") or "")
        try:
            interval = float(event.get("interval") or 2.0)
        except (TypeError, ValueError):
            interval = 2.0
        with self._lock:
            self._heard[hostname] = (
                time.monotonic(),
                interval,
                str(event.get("workerStart") or ""),
            )

    def _on_leaving(self, event: Mapping[str, Any]) -> None:
        hostname, start = str(event.get("hostname") or ""), str(event.get("workerStart") or "")
        with self._lock:
            self._heard.pop(hostname, None)
            for pending in self._pending.values():
                if pending.holder == hostname and (
                    not start or pending.holder_start in ("", start)
                ):
                    pending.holder = ""  # back in the broker, for another worker

    def _silent_holder(self, pending: _Pending, now: float) -> str | None:
        """The worker holding the run's message, when it has fallen silent while the bridge
        was listening the whole time (a bridge cut off from the broker judges no one), or when
        its name is heard from another start of the process (it was killed and started again:
        what it held died with it)."""
        heard = self._heard.get(pending.holder) if pending.holder else None
        if heard is None or self._listening_since is None:
            return None
        last, interval, start = heard
        if start and pending.holder_start and start != pending.holder_start:
            return pending.holder
        silence = max(SILENT_MIN_SECONDS, SILENT_BEATS * interval)
        if now - last <= silence or now - self._listening_since <= silence:
            return None
        return pending.holder

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
            stranded = [
                (p, holder)
                for p in self._pending.values()
                if p not in overdue and (holder := self._silent_holder(p, now)) is not None
            ]
            for pending in overdue + [p for p, _ in stranded]:
                del self._pending[pending.run_id]
            runs = list(self._pending.values())
            if overdue or stranded:
                self._lock.notify_all()
        for pending, holder in stranded:
            logger.warning(
                "run_id=%s job=%s attempt=%s was received by Celery worker %s, since silent or "
                "started again: "
                "no longer extending its lease (the scheduler retries it when it expires)",
                pending.run_id,
                pending.job,
                pending.attempt,
                holder,
                extra=pending.fields(),
            )
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
        lost = self._extend([(pending.run_id, pending.token) for pending in runs])
        for pending in runs:
            if pending.run_id in lost:
                # Done before its handoff event arrived, or reaped, or cancelled.
                self._drop(pending, lost[pending.run_id].detail)

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
                    failures += 1
                    if not self._lease_failed(exc, failures):
                        return
                except PublishFailed as exc:
                    logger.error("the broker refused messages; leasing again once it answers: %s",
                                 exc)  # fmt: skip
                    failures = self._await_broker(failures)
                else:
                    failures = 0
        except Exception as exc:
            logger.exception("lease loop crashed; stopping the bridge")
            self.failure = f"the lease loop crashed: {exc}"
            self.shutdown.set()
        finally:
            if self._unanswered:
                self._answer(self._unanswered)
                self._unanswered = []
            self._lease_done.set()
            with self._lock:
                self._lock.notify_all()
            self._lease_http.close()

    def lease_once(self) -> int:
        """Lease as many runs as fit under `prefetch` (long-polling) and send them; return how many."""
        room = self._room()
        if not room:
            return 0
        body: dict[str, Any] = {
            "queues": self.queues,
            # Only the jobs that have a Celery task: the queue may hold others.
            "jobs": sorted(self.tasks),
            "max": room,
            "workerId": self.worker_id,
            "leaseSeconds": self.lease_seconds,
            "waitSeconds": self.wait_seconds,
        }
        carried, self._unanswered = self._unanswered, []
        if carried:
            body["results"] = [
                report.item(lease["runId"], lease["fencingToken"]) for lease, report in carried
            ]
        try:
            # An answer not of its shape (a proxy's page, JSON cut short) is a BadAnswer, retried
            # like a 5xx, rather than a crash of this loop.
            leases, answered = self._lease_http.post(
                "/api/v1/leases",
                body,
                timeout=self.wait_seconds + self.http_timeout,
                parse=lease_answer,
            )
        except ApiError as exc:
            if carried:
                self._answer(carried)  # apart, then lease again without them
                if exc.status in (400, 413):
                    return 0
            if self.shutdown.is_set():
                return 0  # the stop hung up the long poll: nothing to retry
            raise
        if carried:
            read_answers([(_leased(lease), report) for lease, report in carried], answered)
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
            with self._lock:
                room_left = len(self._pending) < self.prefetch
            if failure is None and room_left and not self.shutdown.is_set():
                # The next lease request, which follows at once, carries them.
                self._unanswered.extend(answered)
            else:
                self._answer(answered)
        if failure is not None:
            raise PublishFailed(str(failure)) from failure

    def _await_broker(self, failures: int) -> int:
        """Wait, backing off, until the broker takes a connection again (or the bridge stops);
        return the failures counted. Leased meanwhile, every run would be failed unsent and
        leased again after its backoff, spending its attempts for nothing: a broker down for
        30 s dead-lettered every run of the queue without one having run."""
        while not self.shutdown.is_set():
            failures += 1
            delay = backoff_delay(failures, base=0.5, cap=30.0)
            self.shutdown.wait(delay)
            if self.shutdown.is_set() or self._broker_answers():
                break
            logger.warning("the broker still does not answer; trying it again")
        return failures

    def _broker_answers(self) -> bool:
        try:
            with self.app.connection_for_write() as connection:
                connection.ensure_connection(max_retries=1, interval_start=0, timeout=5)
        except Exception as exc:  # each transport raises its own
            logger.debug("the broker does not answer: %s", exc)
            return False
        return True

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
        """Send the answers now, in `POST /api/v1/results`."""
        items = [report.item(lease["runId"], lease["fencingToken"]) for lease, report in answered]
        try:
            self._lease_http.post("/api/v1/results", {"results": items}, attempts=3)
        except ApiError as exc:
            logger.warning(
                "could not answer %d leases (%s); they expire and are retried", len(items), exc
            )

    # -- shutdown ---------------------------------------------------------------------------

    def _shut_down(self) -> None:
        """Stop leasing, give queued runs the grace period to start, then stop.

        1. The lease loop stops: a long poll under way is hung up on (the scheduler rolls its
           claim back, or fails as retryable the runs of an answer it could not send); leases
           of an answer that arrives all the same are sent as usual.
        2. Queued runs keep their leases extended until their tasks start, for up to
           `grace_seconds`: a deploy of the bridge does not cost the runs waiting in Celery.
        3. Runs still queued after that are left to expire: their messages stay in the broker and
           a task that starts after the lease is gone is refused by its first heartbeat.
        4. Stop heartbeats and the event receiver.
        """
        self._lease_http.interrupt()
        with self._lock:
            queued = len(self._pending)
        logger.info(
            "stopping bridge worker_id=%s: no new leases; %d runs queued in Celery, grace %ss",
            self.worker_id,
            queued,
            self.grace_seconds,
        )
        with self._lock:
            self._wait_for_drain(lambda: bool(self._pending))
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
