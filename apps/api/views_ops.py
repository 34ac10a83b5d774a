"""Operations: why a run or a job is not running, the team's queues (depth, pause, resume),
backfill and alerts."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from apps.api import schema as doc
from apps.api.shapes import ops as shape
from apps.api.shapes import parse
from apps.api.views_manage import ManageView, next_page, page_limit
from apps.jobs import alerts, backfill, diagnosis, queues, services
from apps.runs import limits, shards
from apps.runs.clock import database_now, format_utc
from apps.runs.models import reported_state


def reason_json(reason: diagnosis.Reason) -> shape.Reason:
    answer = shape.Reason(code=reason.code, message=reason.message)
    if reason.detail:
        answer["detail"] = reason.detail
    return answer


def queue_json(queue: queues.QueueView) -> shape.Queue:
    return shape.Queue(
        name=queue.name,
        paused=queue.paused,
        depth=queue.depth,
        oldestReadyAt=format_utc(queue.oldest_ready_at),
        lastLeasedAt=format_utc(queue.last_leased_at),
        lastWorkerId=queue.last_worker_id,
        rateLimit=None
        if queue.rate is None
        else {"count": queue.rate.count, "periodSeconds": queue.rate.period_seconds},
        rateUsed=None if queue.rate is None else queue.rate.used,
    )


def backfill_json(
    plan: backfill.BackfillPlan, created: int, confirmed: bool
) -> shape.BackfillAnswer:
    return shape.BackfillAnswer(
        count=len(plan.times),
        existing=plan.existing,
        new=plan.new,
        created=created,
        capped=plan.capped,
        confirmed=confirmed,
        until=format_utc(plan.until),
        sample=[t.local.isoformat() for t in plan.times[:20]],
    )


def alert_json(alert: alerts.Alert) -> shape.Alert:
    return shape.Alert(
        kind=alert.kind,
        job=alert.definition.name,
        runId=alert.run_id,
        dueAt=format_utc(alert.due_at),
        lateBySeconds=alert.late_by,
        sloSeconds=alert.definition.lateness_slo_seconds,
        owner=alert.definition.owner,
        runbookUrl=alert.definition.runbook_url,
        message=alert.message,
    )


class RunWhyView(ManageView):
    @extend_schema(
        operation_id="whyRun",
        summary="Why is this run not running?",
        tags=["operations"],
        parameters=[doc.RUN_ID],
        responses=doc.responses({200: shape.WhyAnswer}, 404),
    )
    def get(self, request: Request, run_id: str) -> Response:
        run = self.run(request, run_id)
        now = database_now()
        reasons = diagnosis.why_run(run, now)
        state = reported_state(run.state, run.available_at, now)  # as the run itself shows it
        return Response(
            shape.WhyAnswer(subject=run_id, state=state, reasons=[reason_json(r) for r in reasons])
        )


class JobWhyView(ManageView):
    @extend_schema(
        operation_id="whyJob",
        summary="Why is this job not running?",
        tags=["operations"],
        parameters=[doc.JOB_NAME],
        responses=doc.responses({200: shape.WhyAnswer}, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        definition = self.definition(request, name)
        reasons = diagnosis.why_definition(definition, database_now())
        return Response(shape.WhyAnswer(subject=name, reasons=[reason_json(r) for r in reasons]))


class QueuesView(ManageView):
    @extend_schema(
        operation_id="listQueues",
        summary="The team's queues with depth and activity",
        tags=["operations"],
        responses=doc.responses({200: shape.QueueList}),
    )
    def get(self, request: Request) -> Response:
        with shards.noting():
            found = queues.overview(self.team(request))
            answer = shape.QueueList(results=[queue_json(q) for q in found])
            if missed := shards.noted():
                answer["unavailableShards"] = missed
        return Response(answer)


def _queue_name(name: str) -> None:
    reason = limits.queue_name_problem(name)
    if reason is not None:
        raise ValidationError({"name": [reason]})


def _queue_answer(request: Request, view: ManageView, name: str) -> Response:
    (answer,) = [q for q in queues.overview(view.team(request)) if q.name == name]
    return Response(queue_json(answer))


class QueueSettingsView(ManageView):
    @extend_schema(
        operation_id="putQueue",
        summary="Set a queue's rate limit (and, when given, its pause)",
        description=(
            "A rate limit holds for the queue's jobs together, on top of each job's own. "
            "Audited as `queue.update`. Needs the `manage` scope."
        ),
        tags=["operations"],
        parameters=[doc.QUEUE_NAME],
        request=shape.QueueSettings,
        responses=doc.responses({200: shape.Queue}, *doc.BODY_PROBLEMS),
    )
    def put(self, request: Request, name: str) -> Response:
        _queue_name(name)
        body = self.body(request, shape.QueueSettings)
        rate = body.rateLimit
        services.set_queue_settings(
            self.team(request),
            name,
            self.actor(request),
            rate_limit=None if rate is None else (rate.count, rate.periodSeconds),
            paused=body.paused,
        )
        return _queue_answer(request, self, name)


class QueuePauseView(ManageView):
    bodyless = frozenset({"POST"})
    paused = True

    @extend_schema(
        operation_id="pauseQueue",
        summary="Pause a queue: nothing new is leased from it",
        tags=["operations"],
        parameters=[doc.QUEUE_NAME],
        request=None,
        responses=doc.responses({200: shape.Queue}, 400),
    )
    def post(self, request: Request, name: str) -> Response:
        _queue_name(name)
        services.set_queue_paused(self.team(request), name, self.paused, self.actor(request))
        return _queue_answer(request, self, name)


class QueueResumeView(QueuePauseView):
    paused = False

    @extend_schema(
        operation_id="resumeQueue",
        summary="Resume a paused queue",
        tags=["operations"],
        parameters=[doc.QUEUE_NAME],
        request=None,
        responses=doc.responses({200: shape.Queue}, 400),
    )
    def post(self, request: Request, name: str) -> Response:
        return super().post(request, name)


class JobBackfillView(ManageView):
    @extend_schema(
        operation_id="backfillJob",
        summary="Run a cron job for every fire time of a past range (preview unless confirmed)",
        tags=["operations"],
        parameters=[doc.JOB_NAME],
        request=shape.BackfillRequest,
        responses=doc.responses({200: shape.BackfillAnswer}, 400, 404, 413, 415),
    )
    def post(self, request: Request, name: str) -> Response:
        definition = self.definition(request, name)
        args = parse(shape.BackfillRequest, request.data)
        try:
            if args.confirm:
                plan, created = backfill.run_backfill(
                    definition, args.from_, args.to, self.actor(request)
                )
            else:
                plan, created = backfill.plan(definition, args.from_, args.to), 0
        except backfill.BackfillError as exc:
            raise ValidationError({key: [reason] for key, reason in exc.errors.items()}) from exc
        return Response(backfill_json(plan, created, args.confirm))


class AlertsView(ManageView):
    query = {"GET": doc.page("where the previous page ended")}

    @extend_schema(
        operation_id="listAlerts",
        summary="Late and missed runs of the last 24 h (definitions with a lateness SLO)",
        description=(
            "Newest first (by due time, then job, kind and run), a page at a time; `total` "
            "counts the window's alerts of every page."
        ),
        tags=["operations"],
        parameters=query["GET"],
        responses=doc.responses({200: shape.AlertList}, 400),
    )
    def get(self, request: Request) -> Response:
        limit = page_limit(request)
        after = None
        if cursor := request.query_params.get("cursor"):
            after = alerts.Position.from_cursor(cursor)
            if after is None:
                raise ValidationError({"cursor": ["Not a cursor from a previous page."]})
        with shards.noting():
            found = alerts.alerts_for(
                self.team(request), database_now(), limit=limit + 1, after=after
            )
            page = found.alerts[:limit]
            answer = shape.AlertList(
                results=[alert_json(alert) for alert in page],
                total=found.total,
                next=(
                    next_page(request, page[-1].position.as_cursor())
                    if len(found.alerts) > limit
                    else None
                ),
            )
            if missed := shards.noted():
                answer["unavailableShards"] = missed
        return Response(answer)
