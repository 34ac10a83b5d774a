"""The notification channels' shapes: a channel (POST, PATCH, answers) and its deliveries."""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired

from pydantic import AfterValidator, Field
from pydantic import with_config as typed_config
from typing_extensions import TypeAliasType, TypedDict

from apps.api.shapes import ANSWER, Body, Instant, problem
from apps.api.shapes.jobs import Text, _patch_of
from apps.api.shapes.worker import JobName, QueueName
from apps.notify.channels import MAX_FILTERS, ChannelSpec
from apps.notify.targets import MAX_TARGET
from apps.teams import labels

EventName = TypeAliasType(
    "EventName",
    Literal[
        "run.dead",
        "job.late",
        "job.missed",
        "dlq.threshold",
        "scheduler.shard_unowned",
        "job.recovered",
    ],
)
ChannelKind = TypeAliasType("ChannelKind", Literal["webhook", "email", "slack"])
DeliveryState = TypeAliasType("DeliveryState", Literal["pending", "sent", "failed"])
Phase = TypeAliasType("Phase", Literal["open", "reminder", "resolved", "test"])


# --- requests ---------------------------------------------------------------------------------


def _label(value: str) -> str:
    # Strings are taken as sent (never trimmed): a name of spaces, or one that only spaces tell
    # from another, is refused instead.
    if not value.strip():
        raise problem("blank", "This field may not be blank.")
    if value != value.strip():
        raise problem("spaces", "No leading or trailing spaces.")
    if labels.unreadable(value):
        raise problem("control-characters", labels.UNREADABLE)
    return value


Label = Annotated[Text, AfterValidator(_label)]


class ChannelSettings(Body):
    """A notification channel of the token's team."""

    name: Label = Field(min_length=1, max_length=100, description="Unique within the team.")
    kind: ChannelKind
    target: Text = Field(
        min_length=1,
        max_length=MAX_TARGET,
        description="An http(s) URL (webhook, Slack incoming webhook) or an email address. "
        "URLs on loopback or private addresses are refused unless the server allows them "
        "(SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS).",
    )
    events: list[EventName] = Field(
        min_length=1, max_length=6, description="The events the channel carries."
    )
    jobs: list[JobName] | None = Field(
        None,
        max_length=MAX_FILTERS,
        description="Only these jobs' events (absent, null or empty: every job); events about "
        "the whole team (`dlq.threshold`, `scheduler.shard_unowned`) are not filtered.",
    )
    queues: list[QueueName] | None = Field(
        None, max_length=MAX_FILTERS, description="Only the events of jobs of these queues."
    )
    enabled: bool = True

    def to_spec(self) -> ChannelSpec:
        return ChannelSpec(
            name=self.name,
            kind=self.kind,
            target=self.target,
            events=list(self.events),
            jobs=list(self.jobs or []),
            queues=list(self.queues or []),
            enabled=self.enabled,
        )


# Named after the model it loosens, as DefinitionPatch is: PatchedChannelSettingsRequest.
ChannelSettingsPatch = _patch_of(
    ChannelSettings,
    "ChannelSettings",
    "The fields to change; the others keep their values. The kind cannot change.",
)


# --- answers ----------------------------------------------------------------------------------


@typed_config(ANSWER)
class Channel(TypedDict):
    id: int
    name: str
    kind: ChannelKind
    target: Annotated[
        str,
        Field(description="A Slack URL is a secret: shown whole only in the creation's answer."),
    ]
    events: list[EventName]
    jobs: list[str]
    queues: list[str]
    enabled: bool
    createdAt: Instant
    updatedAt: Instant
    secret: NotRequired[
        Annotated[
            str,
            Field(
                description="The webhook's signing secret, in the creation's answer only: "
                "keep it now, it is never shown again."
            ),
        ]
    ]


@typed_config(ANSWER)
class ChannelList(TypedDict):
    results: list[Channel]


@typed_config(ANSWER)
class DeliveryAttempt(TypedDict):
    number: int
    at: Instant
    durationMs: int
    ok: bool
    status: Annotated[
        int | None, Field(description="The HTTP status or SMTP code; null when none came.")
    ]
    answer: Annotated[str, Field(description="What the other end said (at most 2 000 chars).")]


@typed_config(ANSWER)
class Delivery(TypedDict):
    id: int
    event: Annotated[str, Field(description="An event, or `test`.")]
    phase: Phase
    state: DeliveryState
    summary: str
    attempts: int
    createdAt: Instant
    nextAttemptAt: Annotated[Instant | None, Field(description="null once sent or failed.")]
    sentAt: Instant | None
    lastStatus: int | None
    lastAnswer: str
    incidentId: int | None
    attemptLog: list[DeliveryAttempt]


@typed_config(ANSWER)
class DeliveryList(TypedDict):
    results: list[Delivery]
    next: Annotated[
        str | None, Field(description="The next page's address; null on the last page.")
    ]
