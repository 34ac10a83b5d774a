from django.apps import AppConfig
from django.core.signals import request_started


def _refresh_shard_map(**kwargs) -> None:
    from apps.runs import shards

    shards.refresh()


class RunsConfig(AppConfig):
    name = "apps.runs"
    label = "runs"

    def ready(self) -> None:
        # Every request routes by a shard map at most a second old (`manage.py moveshard`).
        request_started.connect(_refresh_shard_map, dispatch_uid="runs.refresh_shard_map")
