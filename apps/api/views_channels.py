"""Notification channels of the token's team: list, create, read, change, delete, send a test
message, and each channel's delivery log. The domain is apps/notify/channels.py, which the
dashboard's team page calls too."""

from __future__ import annotations

from dataclasses import asdict

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from apps.api import schema as doc
from apps.api.shapes import channels as shape
from apps.api.views_manage import ManageView, next_page, page_limit
from apps.notify import channels
from apps.notify.models import Channel, Delivery, State
from apps.runs.clock import format_utc

BIGINT = 2**63 - 1

CHANNEL_ID = OpenApiParameter(
    "channel_id",
    {"type": "integer", "minimum": 1, "maximum": BIGINT},
    OpenApiParameter.PATH,
    required=True,
    description="The channel's id. Another team's channel is a 404.",
)


def channel_json(channel: Channel, *, created: bool = False) -> shape.Channel:
    """A channel as the API shows it; `created` adds what is shown only once."""
    answer = shape.Channel(
        id=channel.pk,
        name=channel.name,
        kind=channel.kind,
        target=channel.target if created else channels.shown_target(channel),
        events=list(channel.events),
        jobs=list(channel.jobs),
        queues=list(channel.queues),
        enabled=channel.enabled,
        createdAt=format_utc(channel.created_at),
        updatedAt=format_utc(channel.updated_at),
    )
    if created and channel.secret:
        answer["secret"] = channel.secret
    return answer


def delivery_json(delivery: Delivery) -> shape.Delivery:
    return shape.Delivery(
        id=delivery.pk,
        event=delivery.event,
        phase=delivery.phase,
        state=delivery.state,
        summary=delivery.summary,
        attempts=delivery.attempts,
        createdAt=format_utc(delivery.created_at),
        nextAttemptAt=format_utc(delivery.next_attempt_at)
        if delivery.state == State.PENDING
        else None,
        sentAt=format_utc(delivery.sent_at),
        lastStatus=delivery.last_status,
        lastAnswer=delivery.last_answer,
        incidentId=delivery.incident_id,
        attemptLog=[
            shape.DeliveryAttempt(
                number=attempt.number,
                at=format_utc(attempt.started_at),
                durationMs=attempt.duration_ms,
                ok=attempt.ok,
                status=attempt.status,
                answer=attempt.answer,
            )
            for attempt in sorted(delivery.attempt_log.all(), key=lambda a: a.number)
        ],
    )


def _id(raw: str) -> int | None:
    return int(raw) if raw.isascii() and raw.isdigit() and 0 < len(raw) <= 18 else None


class ChannelView(ManageView):
    def channel(self, request: Request, channel_id: str) -> Channel:
        """The team's channel of this id; a 404 otherwise (audited for another team's)."""
        pk = _id(channel_id)
        found = Channel.objects.select_related("team").filter(pk=pk).first() if pk else None
        if found is not None and found.team_id != self.team(request).pk:
            self._deny(request, found.team, "channel", str(found.pk))
            found = None
        if found is None:
            raise NotFound("No such channel.")
        return found


def _saved(call) -> Channel:
    try:
        return call()
    except channels.ChannelError as exc:
        raise ValidationError(exc.errors) from exc
    except channels.ChannelGone:
        raise NotFound("No such channel.") from None


class ChannelsView(ChannelView):
    @extend_schema(
        operation_id="listChannels",
        summary="List the team's notification channels",
        description="Needs the `manage` scope.",
        tags=["notifications"],
        responses=doc.responses({200: shape.ChannelList}),
    )
    def get(self, request: Request) -> Response:
        found = Channel.objects.filter(team=self.team(request)).order_by("name")
        return Response(shape.ChannelList(results=[channel_json(c) for c in found]))

    @extend_schema(
        operation_id="createChannel",
        summary="Create a notification channel",
        description=(
            "A webhook (JSON signed with `X-Cronlease-Signature`), an email address or a Slack "
            "incoming webhook. The answer carries the webhook's `secret` (and a Slack URL "
            "whole): shown this once. Audited as `channel.create`. Needs the `manage` scope."
        ),
        tags=["notifications"],
        request=shape.ChannelSettings,
        responses=doc.responses({201: shape.Channel}, *doc.BODY_PROBLEMS),
    )
    def post(self, request: Request) -> Response:
        spec = self.body(request, shape.ChannelSettings).to_spec()
        channel = _saved(lambda: channels.create(self.team(request), spec, self.actor(request)))
        return Response(channel_json(channel, created=True), status=status.HTTP_201_CREATED)


class ChannelDetailView(ChannelView):
    @extend_schema(
        operation_id="getChannel",
        summary="Get a notification channel",
        description="Needs the `manage` scope.",
        tags=["notifications"],
        parameters=[CHANNEL_ID],
        responses=doc.responses({200: shape.Channel}, 404),
    )
    def get(self, request: Request, channel_id: str) -> Response:
        return Response(channel_json(self.channel(request, channel_id)))

    @extend_schema(
        operation_id="updateChannel",
        summary="Change some fields of a notification channel",
        description=(
            "Merge the given fields into the channel (its kind and secret stay). Audited as "
            "`channel.update`. Needs the `manage` scope."
        ),
        tags=["notifications"],
        parameters=[CHANNEL_ID],
        request=shape.ChannelSettingsPatch,
        responses=doc.responses({200: shape.Channel}, *doc.BODY_PROBLEMS, 404),
    )
    def patch(self, request: Request, channel_id: str) -> Response:
        channel = self.channel(request, channel_id)
        given = self.body(request, shape.ChannelSettingsPatch).model_dump(exclude_unset=True)

        def merged(current: channels.ChannelSpec) -> channels.ChannelSpec:
            body = {**asdict(current), **given}
            return self.body(request, shape.ChannelSettings, body).to_spec()

        channel = _saved(lambda: channels.update(channel, merged, self.actor(request)))
        return Response(channel_json(channel))

    @extend_schema(
        operation_id="deleteChannel",
        summary="Delete a notification channel",
        description=(
            "With its delivery log; messages not yet sent are dropped. Audited as "
            "`channel.delete`. Needs the `manage` scope."
        ),
        tags=["notifications"],
        parameters=[CHANNEL_ID],
        request=None,
        responses=doc.responses({204: None}, 404),
    )
    def delete(self, request: Request, channel_id: str) -> Response:
        channel = self.channel(request, channel_id)
        _saved(lambda: channels.delete(channel, self.actor(request)))
        return Response(status=status.HTTP_204_NO_CONTENT)


class ChannelTestView(ChannelView):
    bodyless = frozenset({"POST"})

    @extend_schema(
        operation_id="testChannel",
        summary="Send a test message to a channel now",
        description=(
            "Sent at once, through the outbox: the answer is the delivery after its first "
            "attempt (`sent`, or `pending` with the answer that failed, retried with backoff, "
            "or `failed`). Audited as `channel.test`. Needs the `manage` scope."
        ),
        tags=["notifications"],
        parameters=[CHANNEL_ID],
        request=None,
        responses=doc.responses({200: shape.Delivery}, 404),
    )
    def post(self, request: Request, channel_id: str) -> Response:
        delivery = channels.send_test(self.channel(request, channel_id), self.actor(request))
        return Response(delivery_json(delivery))


class ChannelDeliveriesView(ChannelView):
    query = {"GET": doc.page("a delivery id")}

    @extend_schema(
        operation_id="listChannelDeliveries",
        summary="A channel's delivery log, newest first",
        description=(
            "Each message with its state, attempts and every attempt's answer. Needs the "
            "`manage` scope."
        ),
        tags=["notifications"],
        parameters=[CHANNEL_ID, *query["GET"]],
        responses=doc.responses({200: shape.DeliveryList}, 400, 404),
    )
    def get(self, request: Request, channel_id: str) -> Response:
        channel = self.channel(request, channel_id)
        limit = page_limit(request)
        found = Delivery.objects.filter(channel=channel)
        cursor = request.query_params.get("cursor")
        if cursor:
            before = _id(cursor)
            if before is None:
                raise ValidationError({"cursor": ["Not a cursor from a previous page."]})
            found = found.filter(pk__lt=before)
        page = list(found.order_by("-pk").prefetch_related("attempt_log")[: limit + 1])
        next_url = None
        if len(page) > limit:
            page = page[:limit]
            next_url = next_page(request, str(page[-1].pk))
        return Response(shape.DeliveryList(results=[delivery_json(d) for d in page], next=next_url))
