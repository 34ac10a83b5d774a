"""The outbox: deliveries written with their incident, claimed by one daemon, sent, recorded.

1. `enqueue` writes one row per channel inside the caller's transaction (the incident's), so the
   page exists exactly when the incident does.
2. `claim` takes due rows with `FOR UPDATE SKIP LOCKED` and in the same statement moves their
   `next_attempt_at` past a lease (the timeout, twice, plus a margin) and stamps a claim id: no
   transaction stays open while the message is on the wire, and two daemons never take the
   same row. A daemon killed before it claims leaves the row due for the next one; killed while
   sending, the row comes back when the lease passes (sent twice only then: at least once).
3. `record` writes the outcome and the attempt's log line in one transaction, only while the
   claim is still the row's: sent, pending again after a backoff, or failed for good.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import DateTimeField, Func
from django.utils import timezone

from apps.notify import transports
from apps.notify.models import TEST_EVENT, Channel, Delivery, DeliveryAttempt, Incident, State

log = logging.getLogger(__name__)

# Served by delivery_due (pending rows by next_attempt_at, id). `only` narrows it to one row
# (the dashboard's and the API's "send test", sent at once by the web process).
CLAIM = """
UPDATE notify_delivery d
SET next_attempt_at = now() + make_interval(secs => %(lease)s),
    claim = %(claim)s,
    attempts = d.attempts + 1
FROM (
    SELECT id FROM notify_delivery
    WHERE state = 'pending' AND next_attempt_at <= now() {only}
    ORDER BY next_attempt_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
) due
WHERE d.id = due.id
RETURNING d.id
"""


class TransactionNow(Func):
    """The database's now() (the transaction's start), as the claim compares with; Django's
    Now() is the statement's time."""

    template = "now()"
    output_field = DateTimeField()


def lease_seconds() -> float:
    """How long a claimed row is left to its claimer before another daemon may take it."""
    return settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS * 2 + 5


def backoff_seconds(attempt: int) -> float:
    """The wait after failed attempt `attempt` (1-based): base · 2^(attempt-1), capped."""
    base = settings.SCHEDULER_NOTIFY_BACKOFF_SECONDS
    return min(settings.SCHEDULER_NOTIFY_BACKOFF_MAX_SECONDS, base * 2 ** (attempt - 1))


def enqueue(
    channels: Iterable[Channel],
    *,
    event: str,
    phase: str,
    summary: str,
    body: str,
    now: datetime,
    incident: Incident | None = None,
) -> list[Delivery]:
    """Write one pending delivery per channel; call it inside the event's transaction."""
    rows = [
        Delivery(
            channel=channel,
            incident=incident,
            event=event,
            phase=phase,
            summary=summary,
            body=body,
            next_attempt_at=now,
            created_at=now,
        )
        for channel in channels
    ]
    return Delivery.objects.bulk_create(rows)


def claim(*, limit: int = 1, only: int | None = None) -> tuple[uuid.UUID, list[int]]:
    """Claim up to `limit` due deliveries (or the one `only`); return the claim and their ids."""
    token = uuid.uuid4()
    params = {"lease": lease_seconds(), "claim": token, "limit": limit}
    sql = CLAIM.format(only="AND id = %(only)s" if only is not None else "")
    if only is not None:
        params["only"] = only
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)
        return token, [row[0] for row in cursor.fetchall()]


def deliver(delivery_id: int, token: uuid.UUID) -> Delivery | None:
    """Send one claimed delivery and record the outcome; return it as recorded."""
    delivery = Delivery.objects.select_related("channel").filter(pk=delivery_id).first()
    if delivery is None or delivery.claim != token:
        return None
    channel = delivery.channel
    started = timezone.now()
    if not channel.enabled and delivery.event != TEST_EVENT:
        outcome = transports.Outcome(False, None, "The channel is disabled.", retryable=False)
    else:
        try:
            outcome = transports.send(channel, delivery.body)
        except Exception as exc:  # a bug in one message must not stop the others
            log.exception("delivery %s to channel %s failed", delivery.pk, channel.pk)
            outcome = transports.Outcome(False, None, f"{type(exc).__name__}: {exc}", True)
    return record(delivery, token, outcome, started)


def record(
    delivery: Delivery, token: uuid.UUID, outcome: transports.Outcome, started: datetime
) -> Delivery | None:
    """Write the attempt and the delivery's new state in one transaction, if still claimed.

    Sent; or pending again after the backoff; or failed once the attempts are spent or the
    answer says another try will not help."""
    attempt = delivery.attempts
    if outcome.ok:
        changes = {"state": State.SENT, "sent_at": TransactionNow()}
    elif outcome.retryable and attempt < settings.SCHEDULER_NOTIFY_MAX_ATTEMPTS:
        wait = timedelta(seconds=backoff_seconds(attempt))
        changes = {"state": State.PENDING, "next_attempt_at": TransactionNow() + wait}
    else:
        changes = {"state": State.FAILED}
    with transaction.atomic():
        updated = Delivery.objects.filter(pk=delivery.pk, claim=token, state=State.PENDING).update(
            last_status=outcome.status, last_answer=outcome.answer, claim=None, **changes
        )
        if not updated:
            # Another daemon took the row over after our lease ran out: its outcome stands.
            return None
        DeliveryAttempt.objects.create(
            delivery=delivery,
            number=attempt,
            started_at=started,
            duration_ms=outcome.duration_ms,
            ok=outcome.ok,
            status=outcome.status,
            answer=outcome.answer,
        )
    delivery.refresh_from_db()
    if not outcome.ok:
        log.warning(
            "delivery %s (%s) to channel %s, attempt %d: %s",
            delivery.pk,
            delivery.event,
            delivery.channel_id,
            attempt,
            outcome.answer[:200],
        )
    return delivery


def deliver_next() -> bool:
    """Claim and send the next due delivery; return True when there was one (call again)."""
    token, ids = claim(limit=1)
    for delivery_id in ids:
        deliver(delivery_id, token)
    return bool(ids)


def deliver_now(delivery: Delivery) -> Delivery:
    """Send this delivery at once (a test message), if no daemon has taken it meanwhile."""
    token, ids = claim(only=delivery.pk)
    if ids:
        recorded = deliver(delivery.pk, token)
        if recorded is not None:
            return recorded
    delivery.refresh_from_db()
    return delivery


def prune(before: datetime, batch: int = 1000) -> int:
    """Delete up to `batch` deliveries that are done (with their attempts) and `batch` closed
    incidents, older than `before`; return how many went."""
    done = list(
        Delivery.objects.filter(created_at__lt=before)
        .exclude(state=State.PENDING)
        .values_list("pk", flat=True)[:batch]
    )
    Delivery.objects.filter(pk__in=done).delete()
    closed = list(
        Incident.objects.filter(closed_at__lt=before).values_list("pk", flat=True)[:batch]
    )
    Incident.objects.filter(pk__in=closed).delete()
    return len(done) + len(closed)
