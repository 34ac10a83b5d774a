"""The workers list's shapes: the worker ids a team's lease requests named recently."""

from __future__ import annotations

from typing import Annotated, NotRequired

from pydantic import Field
from pydantic import with_config as typed_config
from typing_extensions import TypedDict  # pydantic reads only this one on Python 3.11

from apps.api.shapes import ANSWER, Instant, UnavailableShards


@typed_config(ANSWER)
class Worker(TypedDict):
    """A worker id seen in the window, or holding a leased run."""

    workerId: str
    queues: Annotated[list[str], Field(description="The queues of its latest lease request.")]
    inFlight: Annotated[int, Field(ge=0, description="The team's runs it holds leased now.")]
    lastLeaseAt: Annotated[
        Instant | None, Field(description="When it last asked for work (or leased a run).")
    ]
    lastHeartbeatAt: Annotated[
        Instant | None,
        Field(description="When one of its runs last heartbeated; null when none did."),
    ]


@typed_config(ANSWER)
class WorkerList(TypedDict):
    """The team's workers, by worker id."""

    results: list[Worker]
    unavailableShards: NotRequired[UnavailableShards]
