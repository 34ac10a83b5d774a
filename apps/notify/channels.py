"""Channel changes people ask for: create, change, delete, send a test; each audited.

The API (`/api/v1/channels`) and the dashboard (the team page) call these: `check` validates
what only the domain can (the target's kind and address, the team's limit and names), `create`,
`update`, `delete` and `send_test` change and record. A webhook's secret, and a Slack URL (its
own secret), are shown whole once, in the answer to their creation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from django.conf import settings
from django.db import IntegrityError, transaction

from apps.audit.record import Actor, record
from apps.notify import messages, outbox, signing, targets
from apps.notify.models import TEST_EVENT, Channel, Delivery, Event, Kind
from apps.runs.clock import database_now
from apps.teams.models import Team

EVENTS = [event.value for event in Event]
KINDS = [kind.value for kind in Kind]
MAX_FILTERS = 100


class ChannelError(ValueError):
    """The change cannot be made; `errors` names each field and why (the API's 400)."""

    def __init__(self, errors: dict[str, list[str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))


@dataclass
class ChannelSpec:
    """A channel as asked for (the API's body, the dashboard's form)."""

    name: str
    kind: str
    target: str
    events: list[str]
    jobs: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    enabled: bool = True


def shown_target(channel: Channel) -> str:
    """The target as lists show it: a Slack URL is a secret, so only its host is shown."""
    if channel.kind == Kind.SLACK:
        parts = urlsplit(channel.target)
        return f"{parts.scheme}://{parts.netloc}/…"
    return channel.target


def snapshot(channel: Channel) -> dict:
    """The channel as the audit trail keeps it (never its secret). A Slack URL is kept as its
    host and a fingerprint (the first 8 hex digits of its SHA-256): without it, a new URL on
    the same host compared equal and the change was not audited; a webhook's token has too
    many bits for 32 of a hash to give it away."""
    target = shown_target(channel)
    if channel.kind == Kind.SLACK:
        target += f" (fingerprint {hashlib.sha256(channel.target.encode()).hexdigest()[:8]})"
    return {
        "name": channel.name,
        "kind": channel.kind,
        "target": target,
        "events": list(channel.events),
        "jobs": list(channel.jobs),
        "queues": list(channel.queues),
        "enabled": channel.enabled,
    }


def target_problem(kind: str, target: str) -> str | None:
    """Why `target` cannot be this kind's target (syntax, or a refused address); None if it
    can. A URL's host is resolved here and again at every delivery."""
    if kind == Kind.EMAIL:
        return targets.email_problem(target)
    try:
        targets.check_url(target)
    except targets.TargetRefused as exc:
        return str(exc)
    return None


def check(team: Team, spec: ChannelSpec, existing: Channel | None = None) -> dict[str, list[str]]:
    """Every reason the channel cannot be saved, by field."""
    errors: dict[str, list[str]] = {}
    if spec.kind not in KINDS:
        errors["kind"] = [f"One of {', '.join(KINDS)}."]
    elif existing is None or spec.target != existing.target:
        reason = target_problem(spec.kind, spec.target)
        if reason:
            errors["target"] = [reason]
    if not spec.events:
        errors["events"] = ["Choose at least one event."]
    elif set(spec.events) - set(EVENTS):
        errors["events"] = [f"Events are {', '.join(EVENTS)}."]
    for name, values in (("jobs", spec.jobs), ("queues", spec.queues)):
        if len(values) > MAX_FILTERS:
            errors[name] = [f"At most {MAX_FILTERS}."]
    others = Channel.objects.filter(team=team)
    if existing is not None:
        others = others.exclude(pk=existing.pk)
    if others.filter(name=spec.name).exists():
        errors["name"] = ["The team has a channel of this name."]
    if existing is None and others.count() >= settings.SCHEDULER_NOTIFY_MAX_CHANNELS:
        errors.setdefault("body", []).append(_over_the_cap())
    return errors


def _over_the_cap() -> str:
    return (
        f"A team has at most {settings.SCHEDULER_NOTIFY_MAX_CHANNELS} channels "
        "(SCHEDULER_NOTIFY_MAX_CHANNELS); delete one first."
    )


def _unique(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


def create(team: Team, spec: ChannelSpec, actor: Actor) -> Channel:
    """Create the channel (a webhook gets a new secret); raise ChannelError.

    The returned channel carries its secret and whole target: answer them now, never again."""
    errors = check(team, spec)
    if errors:
        raise ChannelError(errors)
    try:
        with transaction.atomic():
            # Creates for one team take turns from here, so the cap counts every channel
            # committed before: checked only above, eight creates at once made 51 of 50.
            list(Team.objects.select_for_update().filter(pk=team.pk).values_list("pk"))
            if Channel.objects.filter(team=team).count() >= settings.SCHEDULER_NOTIFY_MAX_CHANNELS:
                raise ChannelError({"body": [_over_the_cap()]})
            channel = Channel.objects.create(
                team=team,
                name=spec.name,
                kind=spec.kind,
                target=spec.target,
                secret=signing.new_secret() if spec.kind == Kind.WEBHOOK else "",
                events=_unique(spec.events),
                jobs=_unique(spec.jobs),
                queues=_unique(spec.queues),
                enabled=spec.enabled,
                created_by=actor.user,
            )
            record(
                actor,
                "channel.create",
                team=team,
                target_type="channel",
                target=channel.name,
                after=snapshot(channel),
            )
    except IntegrityError as exc:  # the same name, created at the same moment
        raise ChannelError({"name": ["The team has a channel of this name."]}) from exc
    return channel


class ChannelGone(Exception):
    """The channel was deleted meanwhile (the API's 404)."""


def spec_of(channel: Channel) -> ChannelSpec:
    return ChannelSpec(
        name=channel.name,
        kind=channel.kind,
        target=channel.target,
        events=list(channel.events),
        jobs=list(channel.jobs),
        queues=list(channel.queues),
        enabled=channel.enabled,
    )


def _locked(channel: Channel) -> Channel:
    """The channel's row, locked until the transaction ends; ChannelGone once deleted."""
    locked = (
        Channel.objects.select_for_update(of=("self",))
        .select_related("team")
        .filter(pk=channel.pk)
        .first()
    )
    if locked is None:
        raise ChannelGone(channel.pk)
    return locked


def update(channel: Channel, change: Callable[[ChannelSpec], ChannelSpec], actor: Actor) -> Channel:
    """Change the channel's fields (its kind and secret stay) to `change(its fields now)`, read
    under its row's lock: two changes at once both hold (a PATCH merges into the channel as the
    other left it), and a change of a channel deleted meanwhile raises ChannelGone (saved from
    an earlier read, it wrote the deleted channel back). Raise ChannelError when invalid."""
    try:
        with transaction.atomic():
            channel = _locked(channel)
            spec = change(spec_of(channel))
            if spec.kind != channel.kind:
                raise ChannelError(
                    {"kind": ["A channel's kind cannot change: create another one."]}
                )
            errors = check(channel.team, spec, existing=channel)
            if errors:
                raise ChannelError(errors)
            before = snapshot(channel)
            channel.name = spec.name
            channel.target = spec.target
            channel.events = _unique(spec.events)
            channel.jobs = _unique(spec.jobs)
            channel.queues = _unique(spec.queues)
            channel.enabled = spec.enabled
            channel.save(force_update=True)
            after = snapshot(channel)
            if after != before:
                record(
                    actor,
                    "channel.update",
                    team=channel.team,
                    target_type="channel",
                    target=channel.name,
                    before=before,
                    after=after,
                )
    except IntegrityError as exc:
        raise ChannelError({"name": ["The team has a channel of this name."]}) from exc
    return channel


def delete(channel: Channel, actor: Actor) -> None:
    """Delete the channel with its delivery log (its pending deliveries are not sent);
    ChannelGone when another request deleted it first."""
    with transaction.atomic():
        channel = _locked(channel)
        record(
            actor,
            "channel.delete",
            team=channel.team,
            target_type="channel",
            target=channel.name,
            before=snapshot(channel),
        )
        channel.delete()


def send_test(channel: Channel, actor: Actor) -> Delivery:
    """Send a test message at once (through the outbox, so it is logged and retried like any
    other); return the delivery as its first attempt left it."""
    now = database_now()
    summary = (
        f"A test message from cronlease to the channel '{channel.name}' of {channel.team.slug}."
    )
    with transaction.atomic():
        (delivery,) = outbox.enqueue(
            [channel],
            event=TEST_EVENT,
            phase="test",
            summary=summary,
            body=messages.body(
                event=TEST_EVENT,
                phase="test",
                team_slug=channel.team.slug,
                summary=summary,
                at=now,
            ),
            now=now,
        )
        record(
            actor,
            "channel.test",
            team=channel.team,
            target_type="channel",
            target=channel.name,
            after={"delivery": delivery.pk},
        )
    return outbox.deliver_now(delivery)
