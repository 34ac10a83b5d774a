"""Operations: why a run or a job is not running, and the team's queues (depth, pause, resume)."""

from __future__ import annotations

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from apps.api import schema as doc
from apps.api.serializers import QUEUE_RE
from apps.api.views_manage import ManageView
from apps.jobs import alerts, backfill, diagnosis, queues, services
from apps.runs.clock import database_now


class RunWhyView(ManageView):
    @extend_schema(
        operation_id="whyRun",
        summary="Why is this run not running?",
        tags=["operations"],
        parameters=[doc.RUN_ID],
        responses=doc.responses({200: doc.WhyAnswerSerializer}, 404),
    )
    def get(self, request: Request, run_id: str) -> Response:
        run = self.run(request, run_id)
        reasons = diagnosis.why_run(run, database_now())
        return Response(
            {"subject": run_id, "state": run.state, "reasons": [r.as_json() for r in reasons]}
        )


class JobWhyView(ManageView):
    @extend_schema(
        operation_id="whyJob",
        summary="Why is this job not running?",
        tags=["operations"],
        parameters=[doc.JOB_NAME],
        responses=doc.responses({200: doc.WhyAnswerSerializer}, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        definition = self.definition(request, name)
        reasons = diagnosis.why_definition(definition, database_now())
        return Response({"subject": name, "reasons": [r.as_json() for r in reasons]})


class QueuesView(ManageView):
    @extend_schema(
        operation_id="listQueues",
        summary="The team's queues with depth and activity",
        tags=["operations"],
        responses=doc.responses({200: doc.QueueListSerializer}),
    )
    def get(self, request: Request) -> Response:
        return Response({"results": [q.as_json() for q in queues.overview(self.team(request))]})


class QueuePauseView(ManageView):
    paused = True

    @extend_schema(
        operation_id="pauseQueue",
        summary="Pause a queue: nothing new is leased from it",
        tags=["operations"],
        parameters=[doc.QUEUE_NAME],
        request=None,
        responses=doc.responses({200: doc.QueueSerializer}, 400),
    )
    def post(self, request: Request, name: str) -> Response:
        if not QUEUE_RE.match(name) or len(name) > 100:
            raise ValidationError({"name": ["Use letters, digits, '.', ':', '-' and '_'."]})
        services.set_queue_paused(self.team(request), name, self.paused, self.actor(request))
        (answer,) = [q for q in queues.overview(self.team(request)) if q.name == name]
        return Response(answer.as_json())


class QueueResumeView(QueuePauseView):
    paused = False

    @extend_schema(
        operation_id="resumeQueue",
        summary="Resume a paused queue",
        tags=["operations"],
        parameters=[doc.QUEUE_NAME],
        request=None,
        responses=doc.responses({200: doc.QueueSerializer}, 400),
    )
    def post(self, request: Request, name: str) -> Response:
        return super().post(request, name)


class JobBackfillView(ManageView):
    @extend_schema(
        operation_id="backfillJob",
        summary="Run a cron job for every fire time of a past range (preview unless confirmed)",
        tags=["operations"],
        parameters=[doc.JOB_NAME],
        request=doc.BackfillRequestSerializer,
        responses=doc.responses({200: doc.BackfillAnswerSerializer}, 400, 404, 413, 415),
    )
    def post(self, request: Request, name: str) -> Response:
        definition = self.definition(request, name)
        data = request.data if isinstance(request.data, dict) else {}
        errors: dict[str, list[str]] = {}
        bounds = {}
        for key in ("from", "to"):
            try:
                value = (
                    parse_datetime(str(data.get(key, "")).replace(" ", "+"))
                    if data.get(key)
                    else None
                )
            except ValueError:  # well formed but not a time, e.g. 12:99
                value = None
            if value is None or value.tzinfo is None:
                errors[key] = ["Give an ISO 8601 time with an offset or Z."]
            bounds[key] = value
        confirm = data.get("confirm", False)
        if not isinstance(confirm, bool):
            errors["confirm"] = ["Must be true or false."]
        unknown = set(data) - {"from", "to", "confirm"}
        errors.update({key: ["Unknown field."] for key in sorted(unknown)})
        if errors or not isinstance(request.data, dict):
            raise ValidationError(errors or {"body": ["Expected a JSON object."]})
        try:
            if confirm:
                plan, created = backfill.run_backfill(
                    definition, bounds["from"], bounds["to"], self.actor(request)
                )
            else:
                plan, created = backfill.plan(definition, bounds["from"], bounds["to"]), 0
        except backfill.BackfillError as exc:
            raise ValidationError({key: [reason] for key, reason in exc.errors.items()}) from exc
        except OverflowError as exc:  # a bound at the very ends of datetime's range
            raise ValidationError(
                {"from": ["The range reaches past the years 1 to 9999."]}
            ) from exc
        return Response(
            {
                "count": len(plan.times),
                "existing": plan.existing,
                "new": plan.new,
                "created": created,
                "capped": plan.capped,
                "confirmed": confirm,
                "sample": [t.local.isoformat() for t in plan.times[:20]],
            }
        )


class AlertsView(ManageView):
    @extend_schema(
        operation_id="listAlerts",
        summary="Late and missed runs of the last 24 h (definitions with a lateness SLO)",
        tags=["operations"],
        responses=doc.responses({200: doc.AlertListSerializer}),
    )
    def get(self, request: Request) -> Response:
        found = alerts.alerts_for(self.team(request), database_now())
        return Response({"results": [alert.as_json() for alert in found]})
