"""The workers list: worker ids the token's team leased with recently, and what they hold."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from apps.api import schema as doc
from apps.api.shapes import workers as shape
from apps.api.views_manage import ManageView
from apps.runs import workers
from apps.runs.clock import format_utc


def worker_json(worker: workers.SeenWorker) -> shape.Worker:
    return shape.Worker(
        workerId=worker.worker_id,
        queues=worker.queues,
        inFlight=worker.in_flight,
        lastLeaseAt=format_utc(worker.last_lease_at),
        lastHeartbeatAt=format_utc(worker.last_heartbeat_at),
    )


class WorkersView(ManageView):
    # A fleet reads it too (the contract lists it with the worker protocol): a worker token's
    # view of its own team's workers, as a manage token's.
    also_for_scopes = ("worker",)
    query = {"GET": [doc.WORKER_MINUTES]}

    @extend_schema(
        operation_id="listWorkers",
        summary="Workers seen recently",
        description=(
            "The worker ids of the team's lease requests in the last `minutes`, and any worker "
            "holding a leased run: the queues it last asked for, its runs in flight, its last "
            "lease and heartbeat. Needs the `worker` or the `manage` scope."
        ),
        tags=["operations"],
        parameters=query["GET"],
        responses=doc.responses({200: shape.WorkerList}, 400),
    )
    def get(self, request: Request) -> Response:
        minutes = workers.parse_minutes(request.query_params.get("minutes"))
        if minutes is None:
            raise ValidationError({"minutes": [workers.MINUTES_RULE]})
        found = workers.seen([request.auth.team_id], minutes)
        answer = shape.WorkerList(results=[worker_json(worker) for worker in found.workers])
        if found.unavailable:
            answer["unavailableShards"] = found.unavailable
        return Response(answer)
