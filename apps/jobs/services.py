"""Job definitions and queues: create, replace, update, delete, pause, resume; each audited.

The API and the dashboard both call these functions; none of this logic lives in a view.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from django.db import IntegrityError, transaction

from apps.audit.models import AuditEvent
from apps.audit.record import Actor, record
from apps.jobs import firetimes
from apps.jobs import schedule as sched
from apps.jobs.models import DefinitionGone, JobDefinition, Queue, QueueStart, database_to_write
from apps.runs import leasing, payloads, retention, shards
from apps.runs.clock import database_now
from apps.runs.models import PRIORITY_NAMES
from apps.runs.store import mark_limited, notify_ready

log = logging.getLogger(__name__)


def initial_next_due_at(schedule_json: dict, now: datetime) -> datetime | None:
    """Return when the scheduler should first materialise a definition with this schedule.

    Cron: the first fire time after now within its bounds (a new or resumed definition is not
    back-filled), at or after a startAt still ahead; None once its endAt has passed.
    One-off: its runAt, even if past (it then runs at once). Delayed: now + delay. None: never.
    """
    parsed = sched.parse_schedule(schedule_json)
    if isinstance(parsed, sched.CronSchedule):
        following = firetimes.next_fire_times(parsed, now, 1)
        return following[0].utc if following else None
    if isinstance(parsed, sched.OneOffSchedule):
        return parsed.run_at
    if isinstance(parsed, sched.DelayedSchedule):
        return now + timedelta(seconds=parsed.delay_seconds)
    return None


@dataclass(frozen=True)
class DefinitionSpec:
    """A validated definition as the API and the edit form produce it (model field names)."""

    name: str
    schedule: dict
    queue: str
    priority: int
    timeout_seconds: int
    retry_max_attempts: int
    retry_base_seconds: int
    retry_max_seconds: int
    concurrency: int | None
    payload: Any
    paused: bool
    dry_run: bool
    lateness_slo_seconds: int | None = None
    owner: str = ""
    runbook_url: str = ""
    concurrency_per_key: int | None = None
    concurrency_key_field: str = ""
    rate_limit_count: int | None = None
    rate_limit_period_seconds: int | None = None
    # The switches people flip while the job runs (a pause in an incident, dry run while a job
    # is moved over) that the body left unsaid: a replacement (PUT, jobs as code) keeps them as
    # they are, as a file that never mentions `paused` must not resume a job on every deploy.
    # A creation gives them their defaults.
    keeps: frozenset[str] = frozenset()


def spec_of(definition: JobDefinition) -> DefinitionSpec:
    """The editable fields of a saved definition; payloads.Unavailable when its payload is kept
    in storage and cannot be read."""
    return _spec(definition, payloads.load(definition.payload, definition.payload_key))


def _spec(definition: JobDefinition, payload: Any) -> DefinitionSpec:
    return DefinitionSpec(
        name=definition.name,
        schedule=definition.schedule,
        queue=definition.queue,
        priority=definition.priority,
        timeout_seconds=definition.timeout_seconds,
        retry_max_attempts=definition.retry_max_attempts,
        retry_base_seconds=definition.retry_base_seconds,
        retry_max_seconds=definition.retry_max_seconds,
        concurrency=definition.concurrency,
        payload=payload,
        paused=definition.paused,
        dry_run=definition.dry_run,
        lateness_slo_seconds=definition.lateness_slo_seconds,
        owner=definition.owner,
        runbook_url=definition.runbook_url,
        concurrency_per_key=definition.concurrency_per_key,
        concurrency_key_field=definition.concurrency_key_field,
        rate_limit_count=definition.rate_limit_count,
        rate_limit_period_seconds=definition.rate_limit_period_seconds,
    )


# In a snapshot of a definition whose payload is kept in storage and cannot be read: why.
UNREADABLE = "payloadUnavailable"


def snapshot(definition: JobDefinition) -> dict[str, Any]:
    """The audited and answered view of a definition, in the API's names. A payload kept in
    storage that cannot be read is null, and UNREADABLE says why: such a job is still shown,
    replaced, paused and deleted (read strictly, each answered 503, a pause after it had
    committed), but not edited field by field (`snapshot_to_edit`)."""
    try:
        return snapshot_to_edit(definition)
    except payloads.Unavailable as exc:
        log.warning("job %s: %s", definition.name, exc)
        return {**spec_snapshot(_spec(definition, None)), UNREADABLE: str(exc)}


def snapshot_to_edit(definition: JobDefinition) -> dict[str, Any]:
    """`snapshot`, for a change made to some of its fields (a PATCH, the edit form): the
    others are written back as read, so a payload that cannot be read raises
    payloads.Unavailable (written back as null, it would be lost)."""
    return spec_snapshot(spec_of(definition))


def version_of(fields: dict[str, Any]) -> str:
    """A short digest of a definition's fields (`snapshot`): what a form was opened on, the
    API's ETag. The scheduler's own fields (the next fire time) are not in it."""
    # Numbers as PostgreSQL keeps them (payloads.canonical): the answer to a PUT of `1e25`
    # must carry the version a GET, which reads the stored payload back, answers.
    text = json.dumps(
        payloads.canonical(fields), sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def version(definition: JobDefinition) -> str:
    """The definition's version now: the API's ETag of it."""
    return version_of(snapshot(definition))


# How far back through a job's audit trail `fields_at` looks for the version a form was opened on.
FIELDS_AT_EVENTS = 100


def fields_at(definition: JobDefinition, seen: str) -> dict[str, Any] | None:
    """The definition's fields (`snapshot`) as they were at version `seen`: its fields now, with
    the `before` of each change its audit trail records put back, newest first, until they are
    at that version. None when the trail does not lead there (another job of the name before
    it, a change whose event is not in the trail yet, more than FIELDS_AT_EVENTS events)."""
    fields = snapshot(definition)
    events = (
        AuditEvent.objects.filter(
            team_id=definition.team_id, target_type="job", target=definition.name
        )
        .order_by("-id")
        .values_list("action", "before")[:FIELDS_AT_EVENTS]
    )
    for action, before in events:
        if version_of(fields) == seen:
            return fields
        if action in ("job.create", "job.delete"):
            return None
        if isinstance(before, dict):  # a trigger, a backfill change no field: no `before`
            fields = {**fields, **before}
    return fields if version_of(fields) == seen else None


# The versions a change was prepared on (an edit form's, an If-Match's): the change is made
# only to a definition still at one of them. None: to the definition as it is.
Versions = Collection[str] | None


class ChangedMeanwhile(Exception):
    """The definition is not as it was when the change was prepared (an edit form opened
    before someone else's change, an If-Match of an older version): nothing is written."""

    def __init__(self, current: str) -> None:
        self.current = current  # the definition's version now
        super().__init__(f"The job is now at version {current}.")


def spec_snapshot(spec: DefinitionSpec) -> dict[str, Any]:
    """A definition's fields in the API's names (the audit trail's before and after)."""
    return {
        "name": spec.name,
        "schedule": spec.schedule,
        "queue": spec.queue,
        "priority": PRIORITY_NAMES[spec.priority],
        "timeoutSeconds": spec.timeout_seconds,
        "retry": {
            "maxAttempts": spec.retry_max_attempts,
            "baseSeconds": spec.retry_base_seconds,
            "maxSeconds": spec.retry_max_seconds,
        },
        "concurrency": spec.concurrency,
        "payload": spec.payload,
        "paused": spec.paused,
        "dryRun": spec.dry_run,
        "latenessSloSeconds": spec.lateness_slo_seconds,
        "owner": spec.owner,
        "runbookUrl": spec.runbook_url,
        "concurrencyPerKey": spec.concurrency_per_key,
        "concurrencyKeyField": spec.concurrency_key_field,
        "rateLimit": None
        if spec.rate_limit_count is None
        else {"count": spec.rate_limit_count, "periodSeconds": spec.rate_limit_period_seconds},
    }


def _same_schedule(stored: dict, given: dict) -> bool:
    """Whether two schedules' JSON say the same (a default written out or left out is the
    same: the dashboard's form writes every field, the API keeps what it was given)."""
    if stored == given:
        return True
    try:
        return sched.parse_schedule(stored) == sched.parse_schedule(given)
    except sched.ScheduleError:
        return False


def as_stored(spec: DefinitionSpec, stored_schedule: dict) -> DefinitionSpec:
    """`spec` with the stored schedule's JSON when the two say the same, so that writing a
    default out (or leaving it out) is neither a change nor a line in the audit trail."""
    if spec.schedule is stored_schedule or not _same_schedule(stored_schedule, spec.schedule):
        return spec
    return replace(spec, schedule=stored_schedule)


def held(spec: DefinitionSpec, definition: JobDefinition) -> DefinitionSpec:
    """`spec` with the switches it left unsaid (`keeps`) as `definition` has them."""
    if not spec.keeps:
        return spec
    return replace(spec, keeps=frozenset(), **{f: getattr(definition, f) for f in spec.keeps})


# The fields of a spec that are the definition's (`keeps` says how to make one, it is not one).
_STORED = [field for field in DefinitionSpec.__dataclass_fields__ if field != "keeps"]


def _apply_spec(definition: JobDefinition, spec: DefinitionSpec, now: datetime) -> None:
    schedule_changed = definition.pk is None or not _same_schedule(
        definition.schedule, spec.schedule
    )
    for field in _STORED:
        setattr(definition, field, getattr(spec, field))
    definition.payload, definition.payload_key = payloads.place(spec.payload)
    definition.shard = sched.shard_for(spec.name)
    definition.rate_blocked_until = None  # a changed rate limit is looked at afresh
    if schedule_changed:
        definition.next_due_at = initial_next_due_at(spec.schedule, now)
        definition.armed_at = now


def _locked(definition: JobDefinition, versions: Versions = None) -> JobDefinition:
    """The definition's row, locked until the transaction ends; DefinitionGone once another
    client has deleted it, ChangedMeanwhile when it is at none of `versions`."""
    locked = JobDefinition.objects.select_for_update().filter(pk=definition.pk).first()
    if locked is None:
        raise DefinitionGone(definition.name)
    if versions is not None and (now := version(locked)) not in versions:
        raise ChangedMeanwhile(now)
    return locked


class NameTaken(Exception):
    """A definition of this name was created meanwhile, or is still being deleted."""

    def __init__(self, name: str, *, deleting: bool) -> None:
        self.name = name
        self.deleting = deleting
        super().__init__(
            f"The job '{name}' is being deleted; create it again once it is gone."
            if deleting
            else f"A job named '{name}' exists."
        )


def create_definition(team, spec: DefinitionSpec, actor: Actor) -> JobDefinition:
    """Create a definition, audited; NameTaken when the name is (another client's create
    committed first, or a delete of it has not finished)."""
    try:
        with shards.writing(database_to_write(spec.name)):
            definition = JobDefinition(team=team)
            _apply_spec(definition, spec, database_now())
            definition.save()
            record(
                actor,
                "job.create",
                team=team,
                target_type="job",
                target=spec.name,
                after=snapshot(definition),
            )
    except IntegrityError as exc:
        deleting = JobDefinition.everything.named(spec.name).filter(deleting=True).exists()
        raise NameTaken(spec.name, deleting=deleting) from exc
    return definition


def update_definition(
    definition: JobDefinition,
    spec: DefinitionSpec | Callable[[dict[str, Any]], DefinitionSpec],
    actor: Actor,
    *,
    versions: Versions = None,
) -> JobDefinition:
    """Replace a definition's fields; a changed schedule restarts from the next fire time,
    and the runs made ahead of time by the old one that nobody has claimed are deleted, as
    they are when it pauses the definition (and a resume restarts from the next fire time).

    `spec` may be a function of the definition's fields (`snapshot`) as they are once its row
    is locked: a change of some fields (a PATCH) is then made to what another client changed
    meanwhile. Merged into fields read before the lock, it wrote the others back as they had
    been read, undoing a pause made in between. With `versions`, only a definition still at one
    of them is changed (optimistic concurrency: ChangedMeanwhile otherwise)."""
    made_ahead: list[str] = []
    with shards.writing(database_to_write(definition.name)):
        locked = _locked(definition, versions)
        before = snapshot(locked)
        if callable(spec):
            spec = spec(before if UNREADABLE not in before else snapshot_to_edit(locked))
        was_paused, was_limited = locked.paused, locked.limited
        copied = _copied_to_runs(locked)
        spec = as_stored(held(spec, locked), locked.schedule)
        schedule_changed = spec.schedule is not locked.schedule
        replaced_key = locked.payload_key
        _apply_spec(locked, spec, database_now())
        after = snapshot(locked)
        if payloads.same_json(before, after):  # the same body again (1e25 read back whole)
            return locked
        # Paused here as by set_paused: its runs made ahead go, or the pause was back-filled
        # by them (a PUT, a PATCH or a sync stating `paused` left them waiting).
        if schedule_changed or (locked.paused and not was_paused):
            made_ahead = retention.delete_made_ahead(locked.pk)
        elif _copied_to_runs(locked) != copied and not locked.paused:
            # The runs made ahead carry what they were made with: switched to a dry run, or to
            # another queue, the next fire ran for real where it had been. Made again, from
            # the first of their fire times, as the job is now.
            made_ahead, first = retention.made_ahead_deleted(locked.pk)
            if first is not None and (locked.next_due_at is None or first < locked.next_due_at):
                locked.next_due_at = first
        if replaced_key != locked.payload_key:
            # The payload it replaced, kept for good once no row referred to it.
            made_ahead.append(replaced_key)
        if was_paused and not locked.paused:
            locked.next_due_at = _rearmed(locked, database_now())
            locked.armed_at = database_now()
        locked.save()
        if locked.limited != was_limited:
            mark_limited(locked.pk, locked.limited)
        record(
            actor,
            "job.update",
            team=locked.team,
            target_type="job",
            target=locked.name,
            before=before,
            after=after,
        )
        if was_paused and not locked.paused:
            notify_ready([locked.queue])
    payloads.delete_unreferenced(made_ahead)
    return locked


class Doomed(NamedTuple):
    """A definition marked `deleting`, whose runs and row are still to go: where it is."""

    alias: str
    pk: int


def delete_definition(
    definition: JobDefinition, actor: Actor, *, versions: Versions = None
) -> None:
    """Delete a definition with its runs, attempts and payload files, audited.

    First the definition is marked `deleting`, with the audit event, in one short transaction:
    from its commit the job is gone for every reader and writer (404), and no run of it is
    inserted or claimed. Its lock waits for the inserts that hold the definition FOR KEY SHARE
    (apps/runs/store.py, INSERT_RUNS), so none commits after: an enqueue either made its run
    before the delete began, or answers 404 (its key is never answered 201 twice). Then the runs
    go in batches by SQL, each its own transaction, so a definition with a million runs is
    neither loaded into memory (as the ORM's cascade would) nor deleted in one long transaction,
    and the row goes last. A process stopped in between leaves the rest to retention
    (finish_deletions). With `versions`, only a definition still at one of them is deleted.
    """
    finish_or_leave(begin_delete(definition, actor, versions=versions))


def begin_delete(definition: JobDefinition, actor: Actor, *, versions: Versions = None) -> Doomed:
    """The first step of a delete (delete_definition): mark the definition, audited, in a
    transaction of its own or the caller's. Its runs go with `finish_delete`, after it commits."""
    alias = database_to_write(definition.name)
    with shards.writing(alias):
        locked = _locked(definition, versions)
        locked.deleting = True
        locked.next_due_at = None  # off the materialiser's index
        locked.save(update_fields=["deleting", "next_due_at", "updated_at"])
        record(
            actor,
            "job.delete",
            team=definition.team,
            target_type="job",
            target=definition.name,
            before=snapshot(locked),
        )
    return Doomed(alias, locked.pk)


def finish_or_leave(doomed: Doomed) -> None:
    """`finish_delete`, or, when its database fails on the way, leave the rest to retention:
    the delete has begun (the job is gone for every call), so it is not the caller's failure."""
    try:
        finish_delete(doomed)
    except shards.DOWN as exc:
        log.warning(
            "the runs of deleted job %s are left to retention: %s", doomed.pk, type(exc).__name__
        )


def finish_delete(doomed: Doomed) -> None:
    """Delete the runs of a definition marked `deleting`, in batches, then its row."""
    alias, pk = doomed
    with shards.using(alias):
        retention.delete_runs_of(pk)
    with shards.writing(alias):
        gone = JobDefinition.everything.select_for_update().filter(pk=pk).first()
        if gone is None:
            return  # finished by another (retention, or a delete's process it took for stopped)
        # Another deleter of it may still be at its batches.
        retention.delete_runs_of(pk)
        gone.delete()
    payloads.delete_unreferenced([gone.payload_key])


# A delete marked this long ago is taken for one its process left (were that process still at
# the batches of a very large job, sharing the rest with it is harmless).
LEFT_AFTER = timedelta(minutes=1)


def finish_deletions() -> int:
    """Finish the deletes that their process did not (stopped between marking the definition
    and deleting its row), on every shard database that answers; return how many. Found by the
    partial index job_deleting (empty but while a delete runs)."""

    def here() -> int:
        alias = shards.current()
        left = list(
            JobDefinition.everything.using(alias).filter(
                deleting=True, updated_at__lt=database_now() - LEFT_AFTER
            )
        )
        for definition in left:
            finish_delete(Doomed(alias, definition.pk))
        return len(left)

    finished, _ = shards.gather(here)
    return sum(finished)


def set_paused(
    definition: JobDefinition, paused: bool, actor: Actor, *, versions: Versions = None
) -> tuple[JobDefinition, bool]:
    """Pause or resume a definition, and say whether it changed (False: it was so already).
    Pausing deletes the runs its schedule made ahead of their time that nobody has claimed;
    resuming restarts from the next fire time: no back-fill. With `versions`, only a
    definition still at one of them is changed."""
    made_ahead: list[str] = []
    with shards.writing(database_to_write(definition.name)):
        locked = _locked(definition, versions)
        if locked.paused == paused:
            return locked, False
        locked.paused = paused
        if paused:
            made_ahead = retention.delete_made_ahead(locked.pk)
        else:
            locked.next_due_at = _rearmed(locked, database_now())
            locked.armed_at = database_now()
            notify_ready([locked.queue])
        locked.save(update_fields=["paused", "next_due_at", "armed_at", "updated_at"])
        record(
            actor,
            "job.pause" if paused else "job.resume",
            team=locked.team,
            target_type="job",
            target=locked.name,
            before={"paused": not paused},
            after={"paused": paused},
        )
    payloads.delete_unreferenced(made_ahead)
    return locked, True


def _copied_to_runs(definition: JobDefinition) -> tuple[Any, ...]:
    """What a run takes from its definition when it is made (its own copy)."""
    return (
        definition.queue,
        definition.priority,
        definition.dry_run,
        definition.payload,
        definition.payload_key,
    )


def _rearmed(definition: JobDefinition, now: datetime) -> datetime | None:
    """A resumed definition's next fire time, from now (a pause is not back-filled). One that
    had nothing left to fire (a delayed job that ran, a cron job past its endAt) stays so: a
    delay counted again from now would run it a second time."""
    if definition.next_due_at is None:
        return None
    return initial_next_due_at(definition.schedule, now)


def _queue_schedules_paused(team, queue_name: str) -> None:
    """A paused queue's definitions make no runs (the materialiser passes them over): delete the
    runs they made ahead of their time that nobody has claimed, on every shard database."""

    def drop() -> list[str]:
        with transaction.atomic(using=shards.current()):
            return [
                key
                for pk in JobDefinition.objects.filter(team=team, queue=queue_name).values_list(
                    "pk", flat=True
                )
                for key in retention.delete_made_ahead(pk)
            ]

    made_ahead, _ = shards.gather(drop)
    payloads.delete_unreferenced([key for keys in made_ahead for key in keys])


def _queue_schedules_resumed(team, queue_name: str, now: datetime) -> bool:
    """Restart the next fire times of a resuming queue's definitions from `now`, on every
    shard database, before the queue resumes: a paused queue is not back-filled either. False
    when a database could not be reached: the queue resumes all the same (its other shards'
    runs would wait on that one), and keeps `now` as its `rearm_from` for the scheduler to
    restart that database's definitions when it meets them."""

    def rearm() -> None:
        with transaction.atomic(using=shards.current()):
            for definition in JobDefinition.objects.select_for_update().filter(
                team=team, queue=queue_name, paused=False, next_due_at__isnull=False
            ):
                definition.next_due_at = _rearmed(definition, now)
                definition.armed_at = now
                definition.save(update_fields=["next_due_at", "armed_at"])

    _, unavailable = shards.gather(rearm)
    if unavailable:
        log.warning("queue %s of %s resumed with shards %s unavailable: their schedules restart "
                    "when the scheduler meets them", queue_name, team.slug, unavailable)  # fmt: skip
    return not unavailable


def queue_settings(queue: Queue) -> dict[str, Any]:
    """A queue's settings as the API and the audit show them."""
    rate = None
    if queue.rate_limit_count is not None:
        rate = {"count": queue.rate_limit_count, "periodSeconds": queue.rate_limit_period_seconds}
    return {"paused": queue.paused, "rateLimit": rate}


def set_queue_settings(
    team, queue_name: str, actor: Actor, *, rate_limit: tuple[int, int] | None, paused: bool | None
) -> Queue:
    """Set a queue's rate limit (None: no limit) and, when given, its pause; audited once.

    A new limit holds at once in this process and within a second in every other
    (apps/runs/leasing.py, CONTROL_STATE_SECONDS); the starts already in the window count."""
    rearm_from = _restarted(team, queue_name) if paused is False else None
    with transaction.atomic():
        queue, _ = Queue.objects.select_for_update().get_or_create(team=team, name=queue_name)
        before = queue_settings(queue)
        queue.rate_limit_count, queue.rate_limit_period_seconds = rate_limit or (None, None)
        if paused is not None:
            if paused != queue.paused:
                queue.rearm_from = rearm_from
            queue.paused = paused
        after = queue_settings(queue)
        if after != before:
            queue.save()
            if rate_limit is None:
                QueueStart.objects.filter(queue=queue).delete()
            record(
                actor,
                "queue.update",
                team=team,
                target_type="queue",
                target=queue_name,
                before=before,
                after=after,
            )
            if before["paused"] and not queue.paused:
                notify_ready([queue_name])
            transaction.on_commit(leasing.control_state.forget)
    if paused and not before["paused"]:
        _queue_schedules_paused(team, queue_name)
    return queue


def set_queue_paused(team, queue_name: str, paused: bool, actor: Actor) -> tuple[Queue, bool]:
    """Pause or resume a queue, and say whether it changed (False: it was so already): its runs
    are not leased, and its definitions make no runs while it is paused (those made ahead are
    deleted); resuming restarts their next fire times from now, as a definition's own resume
    does."""
    rearm_from = None if paused else _restarted(team, queue_name)
    changed = False
    with transaction.atomic():
        queue, _ = Queue.objects.select_for_update().get_or_create(team=team, name=queue_name)
        if queue.paused != paused:
            changed = True
            queue.paused = paused
            queue.rearm_from = rearm_from
            queue.save(update_fields=["paused", "rearm_from", "updated_at"])
            record(
                actor,
                "queue.pause" if paused else "queue.resume",
                team=team,
                target_type="queue",
                target=queue_name,
                before={"paused": not paused},
                after={"paused": paused},
            )
            # Held at once by this process's claims, within a second by every other's.
            transaction.on_commit(leasing.control_state.forget)
            if not paused:
                notify_ready([queue_name])
    if changed and paused:
        # After the commit: from then on the materialiser passes them over, so none comes back.
        _queue_schedules_paused(team, queue_name)
    return queue, changed


def _restarted(team, queue_name: str) -> datetime | None:
    """Restart a paused queue's definitions' schedules from now, before it resumes: first,
    while the queue still holds the materialiser off them (resumed the other way round, it
    could meet their past fire times and back-fill the pause). Return the queue's `rearm_from`
    once resumed: now, when a shard database could not be reached; else None."""
    if not _queue_paused(team, queue_name):
        return None
    now = database_now()
    return None if _queue_schedules_resumed(team, queue_name, now) else now


def _queue_paused(team, queue_name: str) -> bool:
    return Queue.objects.filter(team=team, name=queue_name, paused=True).exists()
