"""The worker lease protocol: lease, heartbeat, complete, fail, and their batch forms."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DatabaseError, connections
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework.exceptions import AuthenticationFailed, NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.api import schema as doc
from apps.api.auth import still_active
from apps.api.errors import Conflict, ShardUnavailable, problem
from apps.api.fastpath import Call, FastPathView
from apps.api.renderers import Rendered, render_json
from apps.api.shapes import M, body_size, parse
from apps.api.shapes import worker as shape
from apps.audit.record import Actor, record_denied
from apps.runs import activity, leasing, limits, shards, store
from apps.runs.clock import format_utc
from apps.runs.ids import parse_run_id, public_run_id
from apps.runs.models import PRIORITY_NAMES
from apps.teams import access
from apps.teams.models import Team
from scheduler_site.database import failure_detail, log_failure

logger = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerView(FastPathView, APIView):
    """A worker endpoint: `answer` turns a call into the answer's JSON object.

    Plain JSON POSTs, the workers' calls, take the fast path (apps/api/fastpath.py); anything
    else goes through DRF's dispatch and `post`, to the same `answer`."""

    required_scope = "worker"
    # A key given twice: the last is taken, as orjson reads it. Refusing it costs the
    # standard library's second read of every body, 2.5 µs a result carried (parsers.
    # keys_given_twice), about a twentieth of what the web process spends a run here.
    repeated_keys = True

    def post(self, request: Request, **kwargs) -> Response:
        return Response(self.answer(Call.of(request), **kwargs))

    @staticmethod
    def body(call: Call, model: type[M]) -> M:
        return parse(model, call.data, body_size=body_size(call.request))

    @staticmethod
    def team_ids(call: Call) -> list[int]:
        return access.visible_team_ids(call.user)

    @staticmethod
    def checked(call: Call, outcomes: list[store.Outcome]) -> list[store.Outcome]:
        """Record, once per team, the items that named another team's runs; they are answered
        404 all the same."""
        denied: dict[int, list[str]] = {}
        for outcome in outcomes:
            if outcome.denied_team_id is not None:
                denied.setdefault(outcome.denied_team_id, []).append(public_run_id(outcome.id))
        if not denied:
            # Even with nothing to look up, building the queryset cost a results call 0.3 ms
            # (a tenth of its CPU at 100 items, measured here).
            return outcomes
        try:
            for team in Team.objects.filter(pk__in=denied):
                record_denied(
                    Actor.for_token(call.token),
                    f"{call.request.method} {call.request.path}",
                    team=team,
                    target_type="run",
                    target=denied[team.pk],
                )
        except DatabaseError:
            # The items' own changes have committed (one transaction per shard database): a
            # trail that cannot take the denial must not turn their answer into a 500. Logged
            # with what it would have recorded.
            logger.error(
                "access.denied not recorded: token %s named runs of teams %s",
                call.token.prefix, {team_id: runs for team_id, runs in denied.items()},
                exc_info=True,
            )  # fmt: skip
            if not connections[shards.CONTROL].in_atomic_block:
                connections[shards.CONTROL].close_if_unusable_or_obsolete()
        return outcomes

    @staticmethod
    def beaten(call: Call, outcomes: list[store.Outcome]) -> list[store.Outcome]:
        """Note the heartbeats that extended a lease, for the workers list: a dictionary update
        here, a write every few seconds per team and process (apps/runs/activity.py)."""
        activity.note_heartbeats(
            call.token.team_id, [outcome.id for outcome in outcomes if outcome.status == 200]
        )
        return outcomes


def lease_json(lease: store.Lease) -> shape.Lease:
    # A literal, which a type checker holds to shape.Lease as it would the class's call (the
    # call costs a keyword dict more per lease).
    return {
        "runId": public_run_id(lease.id),
        "job": lease.job,
        "attempt": lease.attempt,
        "idempotencyKey": lease.idempotency_key,
        "fencingToken": lease.fencing_token,
        "leaseExpiresAt": format_utc(lease.lease_expires_at),
        "payload": lease.payload,
        "queue": lease.queue,
        "priority": PRIORITY_NAMES[lease.priority],
        "maxAttempts": lease.max_attempts,
        "dueAt": format_utc(lease.due_at),
        "dryRun": lease.dry_run,
    }


@extend_schema_view(
    post=extend_schema(
        operation_id="leaseRuns",
        summary="Lease ready runs",
        description=(
            "Claim up to `max` ready runs of the given queues for this worker, ordered by "
            "priority then `availableAt`. With `waitSeconds` > 0 the call long-polls until work "
            "is ready or the wait is over, then answers (possibly an empty list). "
            "`results` (the items of `POST /api/v1/results`) are applied first and answered "
            "in `results`, a status each. Needs the `worker` scope."
        ),
        tags=["worker"],
        request=shape.LeaseRequest,
        responses=doc.responses({200: shape.LeaseList}, *doc.BODY_PROBLEMS),
    )
)
class LeasesView(WorkerView):
    """Apply the results a worker carries, then claim up to `max` runs; with `waitSeconds`, wait
    for work (woken by NOTIFY) before answering empty."""

    def answer(self, call: Call) -> Rendered:
        args = self.body(call, shape.LeaseRequest)
        # Applied and committed before the claim, so the slots they free (a job's concurrency,
        # a key's) are free to it; if they cannot be applied the request fails before leasing.
        results = report_results(self, call, args.results) if args.results else None
        request = leasing.LeaseRequest(
            team_id=call.token.team_id,
            team_ids=self.team_ids(call),
            queues=args.queues,
            jobs=args.jobs,
            max_runs=args.max,
            worker_id=args.workerId,
            lease_seconds=args.leaseSeconds,
            wait_seconds=args.waitSeconds,
        )
        # Set by the ASGI handler when the worker hangs up (absent under WSGI and in tests).
        gone = getattr(call.request, "client_gone", None)
        allowed = functools.partial(still_active, call.token)
        if results is None:
            return leasing.claim_or_wait(request, render_leases, gone=gone, allowed=allowed)
        if any(item["status"] == 503 for item in results):
            # A result its database could not take: no new work until it has been reported.
            return render_leases([], results)
        try:
            return leasing.claim_or_wait(
                request, lambda leases: render_leases(leases, results), gone=gone, allowed=allowed
            )
        except AuthenticationFailed:
            return render_leases([], results)  # revoked while it waited: its results stand
        except Exception:
            # The results are committed: they are answered (a 5xx would have the worker send
            # them again). The claim, whatever failed it (its database, an answer that could
            # not be built), rolled back and leases nothing; the next request meets the fault.
            logger.exception("claim failed after the results were applied")
            return render_leases([], results)


def render_leases(
    leases: list[store.Lease],
    results: list[shape.ResultDone | shape.ItemRefused] | None = None,
) -> Rendered:
    answer = shape.LeaseList(leases=[lease_json(lease) for lease in leases])
    if results is not None:
        answer["results"] = results
    return Rendered(render_json(answer))


def _run_pk(run_id: str) -> int:
    pk = parse_run_id(run_id)
    if pk is None:
        raise NotFound("No such run.")
    return pk


def _single(outcome: store.Outcome) -> None:
    if outcome.status == 404:
        raise NotFound("No such run.")
    if outcome.status == 409:
        raise Conflict(outcome.detail, code=outcome.code or None)
    if outcome.status == 503:
        raise ShardUnavailable(outcome.detail)


@extend_schema_view(
    post=extend_schema(
        operation_id="heartbeatRun",
        summary="Extend a lease",
        description="Extend the run's lease by its `leaseSeconds`. Needs the `worker` scope.",
        tags=["worker"],
        parameters=[doc.RUN_ID],
        request=shape.TokenBody,
        responses=doc.responses(
            {200: shape.HeartbeatAnswer},
            *doc.BODY_PROBLEMS,
            404,
            409,
            503,
            e409="The fencing token is stale or the run is no longer leased; nothing changed.",
        ),
    )
)
class HeartbeatView(WorkerView):
    def answer(self, call: Call, run_id: str) -> shape.HeartbeatAnswer:
        pk = _run_pk(run_id)
        body = self.body(call, shape.TokenBody)
        beats = store.heartbeat([(pk, body.fencingToken)], team_ids=self.team_ids(call))
        (outcome,) = self.beaten(call, self.checked(call, beats))
        _single(outcome)
        return shape.HeartbeatAnswer(
            runId=run_id, leaseExpiresAt=format_utc(outcome.lease_expires_at)
        )


@extend_schema_view(
    post=extend_schema(
        operation_id="completeRun",
        summary="Report success",
        description="Mark the leased run `succeeded`, with an optional result. "
        "Needs the `worker` scope.",
        tags=["worker"],
        parameters=[doc.RUN_ID],
        request=shape.CompleteBody,
        responses=doc.responses(
            {200: shape.CompleteAnswer},
            *doc.BODY_PROBLEMS,
            404,
            409,
            503,
            e409="The fencing token is stale or the run is no longer leased; nothing changed.",
        ),
    )
)
class CompleteView(WorkerView):
    def answer(self, call: Call, run_id: str) -> shape.CompleteAnswer:
        pk = _run_pk(run_id)
        data = self.body(call, shape.CompleteBody)
        (outcome,) = self.checked(
            call,
            store.complete([(pk, data.fencingToken, data.result)], team_ids=self.team_ids(call)),
        )
        _single(outcome)
        return shape.CompleteAnswer(runId=run_id, state=outcome.state)


@extend_schema_view(
    post=extend_schema(
        operation_id="failRun",
        summary="Report failure",
        description=(
            "Fail the leased run's attempt: it goes to `retrying` (after a backoff) when "
            "attempts are left and `retryable` is true, else to `dead` (the DLQ). "
            "Needs the `worker` scope."
        ),
        tags=["worker"],
        parameters=[doc.RUN_ID],
        request=shape.FailBody,
        responses=doc.responses(
            {200: shape.FailAnswer},
            *doc.BODY_PROBLEMS,
            404,
            409,
            503,
            e409="The fencing token is stale or the run is no longer leased; nothing changed.",
        ),
    )
)
class FailView(WorkerView):
    def answer(self, call: Call, run_id: str) -> shape.FailAnswer:
        pk = _run_pk(run_id)
        data = self.body(call, shape.FailBody)
        (outcome,) = self.checked(
            call,
            store.fail(
                [(pk, data.fencingToken, _error(data.error), data.retryable)],
                team_ids=self.team_ids(call),
            ),
        )
        _single(outcome)
        return shape.FailAnswer(runId=run_id, state=outcome.state, availableAt=_retry_at(outcome))


def _error(error: shape.ErrorBody | None) -> dict[str, str]:
    if error is None:
        return {"message": "", "type": ""}
    answer = {"message": error.message, "type": error.type}
    if error.stack:
        answer["stack"] = limits.cut_stack(error.stack)
    return answer


def _retry_at(outcome: store.Outcome) -> str | None:
    return format_utc(outcome.available_at) if outcome.state == "retrying" else None


# The codes of the single calls' exceptions (_single) for the same outcomes.
ITEM_CODES = {
    404: NotFound.default_code,
    409: Conflict.default_code,
    503: ShardUnavailable.default_code,
}


def _refused(run_id: str, outcome: store.Outcome | None) -> shape.ItemRefused:
    """A refused item, as the single call's problem details with the item's run id."""
    status = 404 if outcome is None else outcome.status
    detail = (outcome.detail if outcome is not None else "") or "No such run."
    code = (outcome.code if outcome is not None else "") or ITEM_CODES[status]
    refused = shape.ItemRefused(runId=run_id, **problem(status, detail, code=code))
    if outcome is not None and outcome.ended and outcome.state:
        refused["state"] = outcome.state
    return refused


def _parsed(
    items: list[shape.HeartbeatItem] | list[shape.ResultItem],
) -> list[tuple[int | None, Any]]:
    """Each item with its run's primary key (None: not a run id, answered 404 without a query)."""
    return [(parse_run_id(item.runId), item) for item in items]


@extend_schema_view(
    post=extend_schema(
        operation_id="heartbeatRuns",
        summary="Extend many leases",
        description=(
            "Heartbeat many leases in one request, with the rules of the single call; each "
            "item is answered with its own `status` (200, 404, 409, or 503 when the run's "
            "shard is unavailable). Needs the `worker` scope."
        ),
        tags=["worker"],
        request=shape.HeartbeatBatch,
        responses=doc.responses({200: shape.HeartbeatBatchAnswer}, *doc.BODY_PROBLEMS),
    )
)
class BatchHeartbeatsView(WorkerView):
    def answer(self, call: Call) -> shape.HeartbeatBatchAnswer:
        parsed = _parsed(self.body(call, shape.HeartbeatBatch).leases)
        known = [(pk, item.fencingToken) for pk, item in parsed if pk is not None]
        beats = store.heartbeat(known, team_ids=self.team_ids(call)) if known else []
        outcomes = self.beaten(call, self.checked(call, beats)) if beats else []
        return shape.HeartbeatBatchAnswer(
            leases=_per_item(
                parsed,
                {outcome.id: outcome for outcome in outcomes},
                lambda item, outcome: shape.HeartbeatDone(
                    runId=item.runId,
                    status=200,
                    leaseExpiresAt=format_utc(outcome.lease_expires_at),
                ),
            )
        )


@extend_schema_view(
    post=extend_schema(
        operation_id="reportResults",
        summary="Report many results",
        description=(
            "Complete or fail many leased runs in one request, with the rules of the single "
            "calls; each item is answered with its own `status` (200, 404, 409, or 503 when "
            "the run's shard is unavailable). Needs the `worker` scope."
        ),
        tags=["worker"],
        request=shape.ResultBatch,
        responses=doc.responses({200: shape.ResultBatchAnswer}, *doc.BODY_PROBLEMS),
    )
)
class BatchResultsView(WorkerView):
    def answer(self, call: Call) -> shape.ResultBatchAnswer:
        return shape.ResultBatchAnswer(
            results=report_results(self, call, self.body(call, shape.ResultBatch).results)
        )


def report_results(
    view: WorkerView, call: Call, items: list[shape.ResultItem]
) -> list[shape.ResultDone | shape.ItemRefused]:
    """Complete or fail each item's run; an answer per item, in order. An error that stops
    them before anything committed (a database gone mid-statement, not a shard known to be
    down) propagates; the failures' after the completions committed answers their items 503."""
    parsed = _parsed(items)
    known = [(pk, item) for pk, item in parsed if pk is not None]
    team_ids = view.team_ids(call)
    succeeded = [
        (pk, item.fencingToken, item.result) for pk, item in known if item.outcome == "succeeded"
    ]
    failed = [
        (pk, item.fencingToken, _error(item.error), item.retryable)
        for pk, item in known
        if item.outcome == "failed"
    ]
    outcomes = store.complete(succeeded, team_ids=team_ids) if succeeded else []
    if failed:
        try:
            outcomes += store.fail(failed, team_ids=team_ids)
        except DatabaseError as exc:
            if not outcomes:
                raise  # nothing was changed: the request's 503 says so
            # The completions committed in a transaction of their own: answered as made (a
            # 503 over them said "nothing was changed"); the failures, not made, answer 503.
            log_failure(exc, logger)
            detail = failure_detail(exc)
            outcomes += [store.Outcome(item[0], 503, detail=detail) for item in failed]
    by_pk: dict[int, store.Outcome] = {}
    for outcome in view.checked(call, outcomes):
        by_pk[outcome.id] = outcome
    return _per_item(
        parsed,
        by_pk,
        lambda item, outcome: shape.ResultDone(
            runId=item.runId, status=200, state=outcome.state, availableAt=_retry_at(outcome)
        ),
    )


def _per_item(
    parsed: list[tuple[int | None, Any]],
    by_pk: dict[int, store.Outcome],
    done: Callable[[Any, store.Outcome], T],
) -> list[T | shape.ItemRefused]:
    """A batch's answer, item by item in order: `done(item, outcome)` for those that took,
    the refusal (404, 409, 503) for the others."""
    answer: list[T | shape.ItemRefused] = []
    for pk, item in parsed:
        outcome = by_pk.get(pk) if pk is not None else None
        if outcome is None or outcome.status != 200:
            answer.append(_refused(item.runId, outcome))
        else:
            answer.append(done(item, outcome))
    return answer
