from django.apps import AppConfig
from django.core.signals import request_started

# Answered without a database: the liveness probe (which must answer at once while the database
# is down: its first request waited 10-12 s on the map's read, for a server that never answers)
# and the dashboard's static files.
NO_DATABASE_PATHS = ("/healthz", "/static/")


def _refresh_shard_map(*, scope=None, environ=None, **kwargs) -> None:
    from apps.runs import shards

    path = (scope or {}).get("path") or (environ or {}).get("PATH_INFO") or ""
    if path.startswith(NO_DATABASE_PATHS):
        return
    shards.refresh()


class RunsConfig(AppConfig):
    name = "apps.runs"
    label = "runs"

    def ready(self) -> None:
        # Every request routes by a shard map at most a second old (`manage.py moveshard`).
        request_started.connect(_refresh_shard_map, dispatch_uid="runs.refresh_shard_map")
