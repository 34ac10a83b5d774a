"""Incidents: one page per problem, reminders while it lasts, one recovery when it is over.

Every change here is one control-database transaction that writes the incident and the
deliveries announcing it (apps/notify/outbox.py): that is the event's transaction, and the
outbox makes the delivery as durable as the incident.

- `occurred` opens an incident and pages the channels that want it, or adds the occurrence to
  the open incident of the same team, event and subject (no page). An occurrence no later than
  the last incident's latest one was already told (`last_event_at`): nothing happens.
- `review` closes an incident that has seen nothing new for SCHEDULER_NOTIFY_RECOVERY_SECONDS
  and whose job's latest finished run succeeded (a team-wide condition: that was not seen
  again), with a recovery message to the channels that were paged; or reminds the channels of
  an incident still open every SCHEDULER_NOTIFY_REMINDER_SECONDS.

A flapping job (dead, succeeded, dead, …) keeps refreshing its open incident, so it is paged
once and recovers once, after it has stayed quiet for the recovery period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction

from apps.notify import messages, outbox
from apps.notify.models import JOB_EVENTS, Channel, Delivery, Event, Incident
from apps.teams.models import Team

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Occurrence:
    """Something a detector found: its time in the data, and what to say about it."""

    team: Team
    event: str
    subject: str
    at: datetime
    summary: str
    job: str = ""
    queue: str = ""
    run_id: str = ""
    count: int = 1
    # A condition (a full DLQ, shards without an owner) is found again on every look while it
    # lasts: each look keeps its incident open without counting as a new occurrence.
    condition: bool = False
    # A run still waiting (late, or its cron time missed) is found again on every look while
    # it waits: each look keeps the incident open, and only a later time (another run late in
    # its turn) is another occurrence.
    waiting: bool = False


def _body(incident: Incident, event: str, phase: str, summary: str, at: datetime) -> str:
    """`at`: when what the message tells happened (a page, the occurrence's time in the data;
    a reminder or a recovery, its own)."""
    return messages.body(
        event=event,
        phase=phase,
        team_slug=incident.team.slug,
        summary=summary,
        at=at,
        job=incident.job,
        queue=incident.queue,
        run_id=incident.run_id if phase != "resolved" else "",
        incident=incident,
    )


def occurred(occurrence: Occurrence, channels: list[Channel], now: datetime) -> Incident | None:
    """Record an occurrence; return the incident it opened (and paged), or None."""
    o = occurrence
    try:
        with transaction.atomic():
            open_incident = (
                Incident.objects.select_for_update()
                .filter(team=o.team, event=o.event, subject=o.subject, closed_at__isnull=True)
                .first()
            )
            if open_incident is not None:
                _refresh(open_incident, o, now)
                return None
            last = (
                Incident.objects.filter(team=o.team, event=o.event, subject=o.subject)
                .order_by("-opened_at")
                .first()
            )
            if last is not None and o.at <= last.last_event_at:
                return None  # told already (and recovered since)
            wanted = [
                c for c in channels if c.team_id == o.team.pk and c.wants(o.event, o.job, o.queue)
            ]
            if not wanted:
                return None
            incident = Incident.objects.create(
                team=o.team,
                event=o.event,
                subject=o.subject,
                job=o.job,
                queue=o.queue,
                summary=o.summary,
                run_id=o.run_id,
                occurrences=o.count,
                opened_at=now,
                last_event_at=o.at,
                last_seen_at=now,
                last_notified_at=now,
            )
            outbox.enqueue(
                wanted,
                event=o.event,
                phase="open",
                summary=o.summary,
                body=_body(incident, o.event, "open", o.summary, o.at),
                now=now,
                incident=incident,
            )
    except IntegrityError:
        # Another detector opened it at the same moment (the advisory lock makes this rare).
        return None
    log.info(
        "incident %s opened: %s %s (%d channels)", incident.pk, o.event, o.subject, len(wanted)
    )
    return incident


def _refresh(incident: Incident, o: Occurrence, now: datetime) -> None:
    if o.condition or (o.waiting and o.at <= incident.last_event_at):
        incident.last_seen_at = now
        incident.last_event_at = max(incident.last_event_at, o.at)
        incident.summary = o.summary
        incident.save(update_fields=["last_seen_at", "last_event_at", "summary"])
    elif o.at > incident.last_event_at:
        incident.last_event_at = o.at
        incident.last_seen_at = now
        incident.occurrences += o.count
        incident.summary = o.summary
        incident.run_id = o.run_id or incident.run_id
        incident.save(
            update_fields=["last_event_at", "last_seen_at", "occurrences", "summary", "run_id"]
        )


# Whether a job's incident is over: given the incident, True (recovered), False (not yet), or
# None (the job is gone: closed, saying so).
Recovered = Callable[[Incident], bool | None]


def review(channels: list[Channel], now: datetime, recovered: Recovered) -> int:
    """Close the incidents that are over (with their recovery messages) and remind the rest
    when due; return how many incidents changed."""
    quiet = timedelta(seconds=settings.SCHEDULER_NOTIFY_RECOVERY_SECONDS)
    reminder = settings.SCHEDULER_NOTIFY_REMINDER_SECONDS
    changed = 0
    for incident in Incident.objects.filter(closed_at__isnull=True).select_related("team"):
        if now - incident.last_seen_at >= quiet:
            over = recovered(incident) if incident.event in JOB_EVENTS else True
            if over is not False:
                changed += close(incident, channels, now, job_gone=over is None)
                continue
        if reminder > 0 and now - incident.last_notified_at >= timedelta(seconds=reminder):
            changed += remind(incident, channels, now)
    return changed


def remind(incident: Incident, channels: list[Channel], now: datetime) -> int:
    """Page the channels that want the incident's event again: it is still open."""
    with transaction.atomic():
        updated = Incident.objects.filter(
            pk=incident.pk, closed_at__isnull=True, last_notified_at=incident.last_notified_at
        ).update(last_notified_at=now, reminders=incident.reminders + 1)
        if not updated:
            return 0
        incident.reminders += 1
        wanted = [
            c
            for c in channels
            if c.team_id == incident.team_id
            and c.wants(incident.event, incident.job, incident.queue)
        ]
        since = messages.age(now - incident.opened_at)
        seen = messages.age(now - incident.last_seen_at)
        # The count of the whole incident: its summary is its latest occurrence's ("run X is
        # dead" after "3 runs died"), which read as if the incident had shrunk to one.
        times = incident.occurrences
        summary = (
            f"Still open after {since}, {times} occurrence{'s' if times != 1 else ''} "
            f"(last seen {seen} ago): {incident.summary}"
        )
        outbox.enqueue(
            wanted,
            event=incident.event,
            phase="reminder",
            summary=summary,
            body=_body(incident, incident.event, "reminder", summary, now),
            now=now,
            incident=incident,
        )
    return 1


def close(
    incident: Incident, channels: list[Channel], now: datetime, *, job_gone: bool = False
) -> int:
    """Close the incident and tell the channels that were paged about it (and still want to
    hear): `job.recovered` for a job, the same event `resolved` otherwise. `job_gone`: the
    job was deleted, and the message says so (a receiver that was paged resolves its alert
    either way; closed silently, it was left open for good)."""
    with transaction.atomic():
        updated = Incident.objects.filter(pk=incident.pk, closed_at__isnull=True).update(
            closed_at=now
        )
        if not updated:
            return 0
        incident.closed_at = now
        paged = set(Delivery.objects.filter(incident=incident).values_list("channel_id", flat=True))
        is_job = incident.event in JOB_EVENTS
        event = Event.JOB_RECOVERED if is_job else incident.event
        wanted = [c for c in channels if c.pk in paged and c.enabled and event in c.events]
        lasted = messages.age(now - incident.opened_at)
        times = f"{incident.occurrences} occurrence{'s' if incident.occurrences != 1 else ''}"
        if job_gone:
            summary = (
                f"{incident.job} was deleted: its {incident.event} incident is closed "
                f"(open {lasted}, {times})."
            )
        elif is_job:
            summary = (
                f"{incident.job} recovered: its latest run succeeded, and no {incident.event} "
                f"for {messages.age(now - incident.last_seen_at)} (open {lasted}, {times})."
            )
        else:
            # The summary is the condition as last seen, not as it is now: said so. The
            # incident opened when the condition was found, which may be well after it began
            # (shards unowned past a grace): its age is not the outage's length.
            quiet = messages.age(now - incident.last_seen_at)
            summary = (
                f"Resolved, not seen for {quiet} (the incident was open {lasted}). "
                f"Last seen: {incident.summary}"
            )
        outbox.enqueue(
            wanted,
            event=event,
            phase="resolved",
            summary=summary,
            body=_body(incident, event, "resolved", summary, now),
            now=now,
            incident=incident,
        )
    log.info("incident %s closed: %s %s", incident.pk, incident.event, incident.subject)
    return 1
