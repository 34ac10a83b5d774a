"""Notification channels on the team page (team admins): list, create, delete, enable or
disable, send a test message, and each channel's delivery log. Every change goes through
apps.notify.channels, as the API's do."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from django.contrib import messages
from django.http import HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_POST

from apps.dashboard.forms import ChannelForm
from apps.dashboard.http import HtmxHttpRequest, actor, done, render_page, signed_in
from apps.dashboard.views import teams as team_views
from apps.notify import channels
from apps.notify.models import Channel, Delivery, Kind
from apps.teams.models import Team

NEW_CHANNEL_KEY = "dashboard_new_channel"
LOG_SIZE = 50


def team_context(request: HtmxHttpRequest, team: Team, form: ChannelForm | None = None) -> dict:
    """What the team page shows of its channels (`form`: a create form with its errors)."""
    rows = []
    for channel in Channel.objects.filter(team=team).order_by("name"):
        last = Delivery.objects.filter(channel=channel).order_by("-pk").first()
        rows.append({"channel": channel, "target": channels.shown_target(channel), "last": last})
    return {
        "channels": rows,
        "channel_form": form or ChannelForm(team=team),
        # Shown once: taken out of the session by the first page that displays it.
        "new_channel": request.session.pop(NEW_CHANNEL_KEY, None),
    }


def _channel(request: HtmxHttpRequest, team: Team, channel_id: int) -> Channel:
    return team_views.owned(
        request, team, Channel.objects, channel_id, "channel", lambda c: str(c.pk)
    )


def _team_page(slug: str) -> str:
    return reverse("dashboard:team", args=[slug]) + "#channels"


def _channel_page(slug: str, channel_id: int) -> str:
    return reverse("dashboard:channel", args=[slug, channel_id])


def _admin_team(request: HtmxHttpRequest, slug: str) -> Team:
    """The team of the page, for its admins only (a 404 or a 403 otherwise)."""
    return team_views._team(request, slug)


@require_POST
@signed_in
def channel_create(request: HtmxHttpRequest, slug: str) -> HttpResponse:
    team = _admin_team(request, slug)
    form = ChannelForm(request.POST, team=team)
    if form.is_valid() and form.spec is not None:
        try:
            channel = channels.create(team, form.spec, actor(request))
        except channels.ChannelError as exc:
            form.add_reasons(exc.errors)
        else:
            shown: dict[str, Any] = {"name": channel.name, "id": channel.pk}
            if channel.kind == Kind.WEBHOOK:
                shown["secret"] = channel.secret
            elif channel.kind == Kind.SLACK:
                shown["target"] = channel.target
            request.session[NEW_CHANNEL_KEY] = shown
            return done(request, _team_page(slug), f"Created the channel {channel.name}.")
    # Answered as the job form answers its errors: the page again, each reason beside its field.
    return team_views.team_detail_page(request, team, channel_form=form)


@signed_in
def channel_detail(request: HtmxHttpRequest, slug: str, channel_id: int) -> HttpResponse:
    team = _admin_team(request, slug)
    channel = _channel(request, team, channel_id)
    log = list(
        Delivery.objects.filter(channel=channel)
        .order_by("-pk")
        .prefetch_related("attempt_log")[:LOG_SIZE]
    )
    context = {
        "team": team,
        "channel": channel,
        "target": channels.shown_target(channel),
        "deliveries": log,
    }
    return render_page(request, "dashboard/channel_detail.html", context, regions=("page", "log"))


@require_POST
@signed_in
def channel_test(request: HtmxHttpRequest, slug: str, channel_id: int) -> HttpResponse:
    team = _admin_team(request, slug)
    channel = _channel(request, team, channel_id)
    delivery = channels.send_test(channel, actor(request))
    if delivery.state == "sent":
        return done(
            request,
            _channel_page(slug, channel.pk),
            f"Test message delivered to {channel.name} ({delivery.last_status}).",
        )
    if not delivery.last_answer:  # a scheduler took it first: it is on its way
        return done(request, _channel_page(slug, channel.pk), "The test message is being sent.")
    return done(
        request,
        _channel_page(slug, channel.pk),
        f"The test message to {channel.name} was not delivered: {delivery.last_answer[:300]}",
        messages.ERROR,
    )


@require_POST
@signed_in
def channel_enable(request: HtmxHttpRequest, slug: str, channel_id: int) -> HttpResponse:
    team = _admin_team(request, slug)
    channel = _channel(request, team, channel_id)
    enabled = request.POST.get("enabled") == "1"
    try:
        channels.update(channel, lambda now: replace(now, enabled=enabled), actor(request))
    except channels.ChannelError as exc:
        return done(request, _channel_page(slug, channel.pk), str(exc), messages.ERROR)
    except channels.ChannelGone:
        return _gone(request, slug, channel)
    word = "enabled" if enabled else "disabled"
    return done(request, _channel_page(slug, channel.pk), f"{channel.name} is {word}.")


@require_POST
@signed_in
def channel_delete(request: HtmxHttpRequest, slug: str, channel_id: int) -> HttpResponse:
    team = _admin_team(request, slug)
    channel = _channel(request, team, channel_id)
    try:
        channels.delete(channel, actor(request))
    except channels.ChannelGone:
        return _gone(request, slug, channel)
    return done(request, _team_page(slug), f"Deleted the channel {channel.name}.")


def _gone(request: HtmxHttpRequest, slug: str, channel: Channel) -> HttpResponse:
    text = f"The channel {channel.name} was deleted meanwhile."
    return done(request, _team_page(slug), text, messages.ERROR)
