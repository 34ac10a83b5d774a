from __future__ import annotations

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.http import HttpRequest, JsonResponse


def healthz(request: HttpRequest) -> JsonResponse:
    """The process is up."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """The database answers and every migration is applied."""
    try:
        connection = connections[DEFAULT_DB_ALIAS]
        executor = MigrationExecutor(connection)
        pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
        return JsonResponse({"status": "unavailable", "detail": str(exc)}, status=503)
    if pending:
        return JsonResponse(
            {"status": "unavailable", "detail": f"{len(pending)} migrations pending"}, status=503
        )
    return JsonResponse({"status": "ok"})
