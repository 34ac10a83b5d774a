"""Creating runs of definitions: delayed, one-off and immediate runs asked for through the API
(one or a batch), the dashboard's "trigger now", and the demo.

A batch is one statement per shard database (`insert_keyed`: set-based, ON CONFLICT DO NOTHING
on definition + idempotency key) and one NOTIFY per queue, whatever its size. Each item ends on
its own: 201 created, 200 the run its key already names (same payload, or none given), 409 that
run has another payload, 404 no such job for the caller's teams, 503 its shard's database is down. The same key is taken for as long as its
run is kept (retention), and concurrent batches naming it create it once (the unique index).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import orjson
from django.db import DatabaseError, IntegrityError, InterfaceError, OperationalError, transaction

from apps.audit.record import TARGETS_SHOWN, Actor, kept_with_rows, record, record_denied
from apps.jobs.models import DefinitionGone, JobDefinition, database_of
from apps.jobs.schedule import shard_for
from apps.runs import payloads, shards
from apps.runs.clock import format_utc
from apps.runs.ids import public_run_id
from apps.runs.models import Run, Trigger
from apps.runs.store import NewRun, array_literal, insert_keyed, server_cursor, unavailable
from apps.runs.transitions import TransitionError
from apps.teams.models import Team

log = logging.getLogger(__name__)


class IdempotencyConflict(TransitionError):
    """The idempotency key names an existing run whose payload differs from the one asked for."""

    def __init__(self, run: Run, fields: list[str]) -> None:
        where = f" (fields that differ: {', '.join(fields)})" if fields else ""
        super().__init__(
            f"The idempotency key '{run.idempotency_key}' belongs to {run.run_id}, created "
            f"with a different payload{where}; use a new key for a new run."
        )
        self.run = run
        self.fields = fields


@dataclass(frozen=True)
class Created:
    run: Run | CreatedRun
    created: bool


def payload_difference(existing: Any, asked: Any) -> list[str] | None:
    """None when the payloads are equal, else the top-level fields that differ ([] when one is
    not an object)."""
    if payloads.same_json(existing, asked):
        return None
    if isinstance(existing, dict) and isinstance(asked, dict):
        keys = set(existing) | set(asked)
        return sorted(
            k
            for k in keys
            if not payloads.same_json(existing.get(k, _MISSING), asked.get(k, _MISSING))
        )
    return []


_MISSING = object()


class Wanted(NamedTuple):
    """One run asked for: of which job, under which key, when, with what."""

    job: str
    idempotency_key: str | None = None
    delay_seconds: int | None = None
    run_at: datetime | None = None
    payload: Any = None  # None: the definition's payload
    priority: int | None = None  # None: the definition's priority
    concurrency_key: str | None = None


class Enqueued(NamedTuple):
    """What one item came to: 201, 200, 404 or 409 (with `run` for 201, 200 and 409)."""

    status: int
    run: Run | CreatedRun | NamedRun | None = None
    detail: str = ""
    fields: tuple[str, ...] = ()  # for a 409: the payload's top-level fields that differ


@dataclass(frozen=True)
class Batch:
    """A batch's answers, in order, and the database clock its delays counted from (None when
    no item named a job of the caller's teams)."""

    answers: list[Enqueued]
    now: datetime | None


def enqueue_many(
    team_ids: Sequence[int],
    items: Sequence[Wanted],
    actor: Actor,
    *,
    trigger: str = Trigger.API,
    now: datetime | None = None,
    full: bool = True,
    triggered: bool = False,
) -> Batch:
    """Create the runs asked for, in one statement per shard database; answer each item in
    order. Delays count from `now`, the database's clock as the caller read it (read with the
    definitions when not given). A new run is answered whole (CreatedRun), or, when not `full`,
    by what names it (NamedRun).

    1. Find the items' definitions by name (one query per database); a job not of `team_ids` is
       a 404 for its items (another team's is audited once per team, as a denial).
    2. Insert each database's runs at once; the new ones are audited in the same transaction
       (one event per job: `run.create`, or `job.trigger` for a job run now on request,
       `triggered` or manual).
    3. Read the runs the others' keys name (one query), and compare payloads.
    A shard database that cannot be reached answers 503 for its items (apps/runs/shards.py).
    """
    definitions, down = _definitions({item.job for item in items})
    foreign: dict[Any, list[str]] = {}
    if now is None and definitions:
        now = next(iter(definitions.values())).database_now
    wanted: list[tuple[Wanted, NewRun] | str | None] = []
    # One instant per delay: a batch's runs mostly share theirs, and an instant met again is
    # hashed and written once (insert_keyed, format_utc) instead of once per run.
    due_after: dict[int, datetime] = {}
    for item in items:
        if item.job in down:
            wanted.append(down[item.job])
            continue
        definition = definitions.get(item.job)
        if definition is None or definition.team_id not in team_ids:
            if definition is not None:
                foreign.setdefault(definition.team, []).append(item.job)
            wanted.append(None)
            continue
        due = item.run_at
        if due is None:
            delay = item.delay_seconds or 0
            due = due_after.get(delay)
            if due is None:
                due = due_after[delay] = now + timedelta(seconds=delay)
        key = item.idempotency_key or f"{definition.name}@{trigger}-{uuid.uuid4().hex}"
        new = NewRun(
            definition.pk,
            trigger,
            due,
            due,
            key,
            item.payload,
            item.priority,
            item.concurrency_key,
        )
        wanted.append((item, new))
    for team, names in foreign.items():
        record_denied(actor, "enqueue", team=team, target_type="job", target=names)
    by_id = {d.pk: d for d in definitions.values()}
    teams = {pk: definition.team for pk, definition in by_id.items()}
    asked = [pair[1] for pair in wanted if isinstance(pair, tuple)]
    rows: dict[tuple[int, str], Any] = {}
    runs: dict[tuple[int, str], Any] = {}
    failed: dict[int, str] = {}  # definition id: why its database could not take the runs

    def answered(
        made: dict[tuple[int, str], Any], part: list[NewRun]
    ) -> dict[tuple[int, str], Any]:
        """In the insert's transaction: the runs of `part` by name, new and named by their keys,
        and the new ones' audit events, kept with them."""
        if full:
            here = {
                name: _new_run(row, by_id[name[0]], teams[name[0]]) for name, row in made.items()
            }
        else:
            here = {
                (new.definition_id, new.idempotency_key): NamedRun(
                    pk,
                    by_id[new.definition_id],
                    teams[new.definition_id],
                    new.idempotency_key,
                    new.due_at,
                )
                for new in part
                if (pk := made.get((new.definition_id, new.idempotency_key))) is not None
            }
        # Only the keys that named an existing run are read back.
        if len(made) < len(part):
            here.update(
                _runs_named({(n.definition_id, n.idempotency_key) for n in part} - set(made))
            )
        _audit_created(actor, [here[name] for name in made], triggered or trigger != Trigger.API)
        return here

    # Each database's runs commit with their audit events (`kept_with_rows`: relayed to the
    # trail once the control database's transaction commits, when that is a shard database of
    # its own): a database failing at its commit after another committed leaves the runs that
    # committed with their events (they were written last, in the control database, and lost).
    by_database = _by_database(asked, by_id)
    committed: list[str] = []  # the shard databases of their own whose insert has committed
    kept: set[tuple[int, str]] = set()  # the new runs committed (raised: none)
    try:
        with kept_with_rows(), transaction.atomic(using=shards.CONTROL):
            # With shards on databases of their own, the batch's large payloads' blobs are held
            # at once on the control database. Held by each database's insert, two batches
            # naming the same two blobs the other way round deadlocked; and a failure there was
            # taken for the shard database's (its items 503, then a 500 on the spoilt
            # transaction): here it fails the request (503). One database needs neither (and is
            # spared measuring each payload twice: ~2 ms for 1 000).
            if shards.physical():
                payloads.hold_all(new.payload for new in asked)
            for alias, asked_here in by_database.items():
                made, here = _insert_on(alias, asked_here, by_id, failed, full=full, then=answered)
                rows.update(made)
                runs.update(here)
                if alias != shards.CONTROL:
                    committed.append(alias)
        kept = set(rows)
    except DatabaseError as exc:
        # The control database's transaction commits last: when it fails (or a statement in it
        # did), the runs of databases that committed before stand, and are answered as such (a
        # 503 for the whole batch invited a retry that duplicated them without keys). The
        # items of the others were not created.
        if not committed:
            raise
        log.warning("enqueue: the control database failed after shard databases committed",
                    exc_info=True)  # fmt: skip
        why = unavailable(shards.CONTROL, exc)
        for alias, asked_here in by_database.items():
            if alias not in committed:
                failed.update(dict.fromkeys((new.definition_id for new in asked_here), why))
        kept = {name for name in rows if name[0] not in failed}
    finally:
        _drop_unused_payloads(asked, kept)
    answers = []
    seen: set[tuple[int, str]] = set()
    for pair in wanted:
        if pair is None:
            answers.append(Enqueued(404, detail="No such job."))
            continue
        if isinstance(pair, str):
            answers.append(Enqueued(503, detail=pair))
            continue
        item, new = pair
        if new.definition_id in failed:
            answers.append(Enqueued(503, detail=failed[new.definition_id]))
            continue
        name = (new.definition_id, new.idempotency_key)
        if name in rows and name not in seen:
            answers.append(Enqueued(201, runs[name]))
        elif name in runs:
            answers.append(_existing(runs[name], item.payload))
        else:
            answers.append(_vanished(by_id[new.definition_id]))
        seen.add(name)
    return Batch(answers, now)


def _drop_unused_payloads(asked: list[NewRun], made: set[tuple[int, str]]) -> None:
    """Delete the stored blobs of the large payloads that made no run (their key named an
    existing run, or their database failed), once the control database's transaction is over:
    placed before the insert, nothing else would. A blob some row refers to (the same payload
    as the existing run's) stays: payloads.delete_unreferenced looks. Only counted when an item
    made no run: most batches make a run of each and pay nothing."""
    if len(made) == len(asked):
        return
    unused = [
        new.payload
        for new in asked
        if new.payload is not None and (new.definition_id, new.idempotency_key) not in made
    ]
    keys = payloads.keys_of(unused)
    if not keys:
        return

    def drop() -> None:
        try:
            payloads.delete_unreferenced(keys)
        except DatabaseError:  # the database the request failed on, say: the answer stands
            log.warning("enqueue: %d unused payload blobs not deleted", len(keys), exc_info=True)

    try:
        transaction.on_commit(drop, using=shards.CONTROL)  # at once outside a transaction
    except DatabaseError:  # asking whether it is in one needs the database: as in drop()
        log.warning("enqueue: %d unused payload blobs not deleted", len(keys), exc_info=True)


def _insert_on(
    alias: str,
    part: list[NewRun],
    by_id: dict[int, JobDefinition],
    failed: dict[int, str],
    *,
    full: bool,
    then: Callable[[dict[tuple[int, str], Any], list[NewRun]], dict[tuple[int, str], Any]],
) -> tuple[dict[tuple[int, str], Any], dict[tuple[int, str], Any]]:
    """Insert `part` on database `alias` in one statement and call `then(made, part)` in its
    transaction: what insert_keyed answered and what `then` did, once committed (nothing when
    the database could not be reached).

    The runs of a shard whose move's guard refuses them answer 503 (`failed`), and the others
    are inserted again without them: a move refuses its own shard's runs only, though this
    process's map may be a second late to know of it. A shard database of its own takes each
    try in a transaction of its own. In the control database the insert runs in the caller's
    transaction: a savepoint keeps it usable once a shard has moved (two statements more);
    before any move is known, a refusal there is a 503 for the request."""
    shared = alias == shards.CONTROL
    while part:
        ids = {new.definition_id for new in part}
        moving: list[int] = []
        own = not shared or shards.ever_moved()
        with shards.using(alias), _unless_unreachable(alias, ids, failed, moving):
            with transaction.atomic(using=alias) if own else nullcontext():
                made = insert_keyed(part, full=full)
                done = then(made, part)
            return made, done
        if not moving:
            return {}, {}  # the database could not be reached: every item answers 503
        if not own:
            raise shards.Moving(moving[0])  # its transaction is spoilt: nothing was written
        for pk in ids:
            if by_id[pk].shard != moving[0]:
                del failed[pk]
        part = [new for new in part if by_id[new.definition_id].shard != moving[0]]
    return {}, {}


def _vanished(definition: JobDefinition) -> Enqueued:
    """The answer for an item whose insert found no definition row to insert for (nor a run
    of that key): the job was deleted meanwhile (404), or its shard moved to another database
    under the insert (503: the next try goes to the new one)."""
    shards.refresh(force=True)
    try:
        with shards.reaching(database_of(definition.name)):
            still = JobDefinition.objects.named(definition.name).filter(pk=definition.pk).exists()
    except shards.Unavailable:
        still = True  # its new database is down: a later try will tell
    if still or definition.shard in shards.moving():
        return Enqueued(503, detail=shards.moving_detail(definition.shard))
    return Enqueued(404, detail="No such job.")


@contextmanager
def _unless_unreachable(
    alias: str, keys: Iterable[Any], down: dict[Any, str], moving: list[int] | None = None
) -> Iterator[None]:
    """With shards on databases of their own, one that cannot be reached fails its items alone
    (they answer 503: `down` gets why, for each of `keys`), not the batch. A shard whose move's
    guard refused a row is added to `moving`."""
    try:
        yield
    except DatabaseError as exc:
        # A process whose map is a moment older than a finished move wrote to the shard's old
        # database, whose guard refuses it (apps/scheduler/moves.py): the same answer as during
        # the move.
        diag = getattr(exc.__cause__, "diag", None)
        constraint = getattr(diag, "constraint_name", "") or ""
        if isinstance(exc, IntegrityError) and constraint.startswith(shards.MOVED_GUARD_PREFIX):
            shard = int(constraint.removeprefix(shards.MOVED_GUARD_PREFIX))
            down.update(dict.fromkeys(keys, shards.moving_detail(shard)))
            if moving is not None:
                moving.append(shard)
            return
        if not shards.physical():
            raise
        # Down, or failed at its commit (any database error): its items alone answer 503.
        if not isinstance(exc, OperationalError | InterfaceError):
            log.warning("enqueue: not inserted on %s", alias, exc_info=True)
        down.update(dict.fromkeys(keys, unavailable(alias, exc)))


def _definitions(
    names: set[str], *, again: bool = True
) -> tuple[dict[str, JobDefinition], dict[str, str]]:
    """The definitions of these names, each read from its shard's database, with that
    database's clock: a request of one run is then two round trips and one transaction (the
    lookup, and the insert with its audit event). And the names whose database is down, with
    what to tell about it.

    A name not found is looked for again when the shard map, read afresh, puts it elsewhere:
    its shard has just moved (`manage.py moveshard`), and this process's map is up to a second
    old."""
    found, down, looked_in = _definitions_on_map(names)
    missing = names - found.keys() - down.keys()
    if missing and again and shards.physical():
        # Against the database each name was looked for in: another thread may have read
        # the new map between that lookup and this refresh.
        shards.refresh(force=True)
        moved = {
            name
            for name in missing
            if shards.alias_of_shard(shard_for(name)) != looked_in[name]
            or shard_for(name) in shards.moving()
        }
        if moved:
            more, more_down = _definitions(moved, again=False)
            found.update(more)
            down.update(more_down)
    return found, down


def _definitions_on_map(
    names: set[str],
) -> tuple[dict[str, JobDefinition], dict[str, str], dict[str, str]]:
    """The definitions found, the names whose database is down or shard moving (with what to
    tell), and the database each other name was looked for in."""
    groups: dict[str, set[str]] = {}
    found: dict[str, JobDefinition] = {}
    down: dict[str, str] = {}
    moving = shards.moving()
    for name in names:
        shard = shard_for(name)
        if shard in moving:
            down[name] = shards.moving_detail(shard)
        else:
            groups.setdefault(shards.alias_of_shard(shard), set()).add(name)
    for alias, part in groups.items():
        with shards.using(alias), _unless_unreachable(alias, part, down):
            found.update((d.name, d) for d in _named(alias, part))
    looked_in = {name: alias for alias, part in groups.items() for name in part}
    return found, down, looked_in


# Only what a batch reads of its definitions (the insert takes the rest from the row itself),
# with the database's clock (delays count from it) and, where the teams share the database,
# each one's team; served by jobs_jobdefinition_name_key. A prepared statement: the ORM's query
# of the same columns took ~0.7 ms of the ~3.8 ms of CPU a one-run request costs the web
# process (in-process, Django's test client).
DEFINITIONS_NAMED = """
SELECT d.id, d.name, d.team_id, d.shard, statement_timestamp(){teams}
FROM jobs_jobdefinition d{join}
WHERE d.name = ANY(%(names)s::text[]) AND NOT d.deleting
"""
DEFINITIONS_NAMED_ALONE = DEFINITIONS_NAMED.format(teams="", join="")
DEFINITIONS_NAMED_WITH_TEAMS = DEFINITIONS_NAMED.format(
    teams=", t.slug, t.name, t.retention_days, t.created_at",
    join=" JOIN teams_team t ON t.id = d.team_id",
)
# In the models' field order, which Model.from_db reads a row's values in.
_DEFINITION_FIELDS = ["id", "name", "team_id", "shard"]
_TEAM_FIELDS = ["id", "slug", "name", "retention_days", "created_at"]


def _named(alias: str, names: set[str]) -> list[JobDefinition]:
    """The definitions of these names on one database, with `database_now` and `team` (a team
    deleted meanwhile: its definitions go with it, they are not answered)."""
    physical = shards.physical()
    with server_cursor() as cursor:
        cursor.execute(
            DEFINITIONS_NAMED_ALONE if physical else DEFINITIONS_NAMED_WITH_TEAMS,
            {"names": array_literal(sorted(names))},
        )
        rows = cursor.fetchall()
    teams = shards.teams_by_id({row[2] for row in rows}) if physical else {}
    found = []
    for row in rows:
        definition = JobDefinition.from_db(alias, _DEFINITION_FIELDS, row[:4])
        definition.database_now = row[4]
        team = (
            teams.get(row[2]) if physical else Team.from_db(alias, _TEAM_FIELDS, (row[2], *row[5:]))
        )
        if team is not None:
            definition.team = team
            found.append(definition)
    return found


def _by_database(
    asked: Sequence[NewRun], by_id: dict[int, JobDefinition]
) -> dict[str, list[NewRun]]:
    """The items by database, the control database's first: a move's guard met there spoils
    the request's transaction and refuses it whole (`_insert_on`), which must happen before
    another database has committed its items (a 503 for runs that were made)."""
    groups: dict[str, list[NewRun]] = {}
    for new in asked:
        alias = shards.alias_of_shard(by_id[new.definition_id].shard)
        groups.setdefault(alias, []).append(new)
    return dict(sorted(groups.items(), key=lambda group: group[0] != shards.CONTROL))


class _NewRunNames:
    """A new run's definition id and public id, from its definition and primary key."""

    __slots__ = ()

    @property
    def definition_id(self) -> int:
        return self.definition.pk

    @property
    def run_id(self) -> str:
        return public_run_id(self.pk)


@dataclass
class CreatedRun(_NewRunNames):
    """A run just inserted, read from the insert's own answer: the attributes a run's
    representation and the audit read. Building Django model instances instead took 42 ms per
    1 000 runs, as long as the insert itself."""

    pk: int
    definition: JobDefinition
    team: Any  # the definition's, read once per batch
    queue: str
    priority: int
    state: str
    trigger: str
    due_at: datetime
    available_at: datetime
    attempt: int
    max_attempts: int
    idempotency_key: str
    concurrency_key: str | None
    dry_run: bool
    payload: Any
    payload_key: str
    created_at: datetime
    fencing_token: None = None
    lease_expires_at: None = None
    worker_id: str = ""
    cancel_requested: bool = False
    result: None = None
    last_error: None = None
    started_at: None = None
    finished_at: None = None


@dataclass(slots=True)
class NamedRun(_NewRunNames):
    """A run just inserted, for a caller that answers it by id (and the audit): read from the
    insert's ids and the batch's own items, without the run's columns (1 000 runs made whole
    cost the web process 5 of its 30-35 ms for the batch)."""

    pk: int
    definition: JobDefinition
    team: Any
    idempotency_key: str
    due_at: datetime


def _new_run(row: dict[str, Any], definition: JobDefinition, team: Any) -> CreatedRun:
    payload = row["payload"]
    return CreatedRun(
        pk=row["id"],
        definition=definition,
        team=team,
        queue=row["queue"],
        priority=row["priority"],
        state=row["state"],
        trigger=row["trigger"],
        due_at=row["due_at"],
        available_at=row["available_at"],
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        idempotency_key=row["idempotency_key"],
        concurrency_key=row["concurrency_key"],
        dry_run=row["dry_run"],
        payload=None if payload is None else orjson.loads(payload),
        payload_key=row["payload_key"],
        created_at=row["created_at"],
    )


def _runs_named(pairs: set[tuple[int, str]]) -> dict[tuple[int, str], Run]:
    """The runs of these (definition, key) pairs (served by the unique (definition,
    idempotency_key) index)."""
    if not pairs:
        return {}
    candidates = Run.objects.select_related("definition").filter(
        definition_id__in={pair[0] for pair in pairs},
        idempotency_key__in={pair[1] for pair in pairs},
    )
    found = {(run.definition_id, run.idempotency_key): run for run in shards.with_teams(candidates)}
    return {name: run for name, run in found.items() if name in pairs}


def _existing(run: Run, payload: Any) -> Enqueued:
    # The same key with another payload is a different request: answering the old run as if it
    # were this one would drop the new payload without a word. A request without a payload
    # asks for none in particular.
    if payload is not None:
        difference = payload_difference(payloads.load(run.payload, run.payload_key), payload)
        if difference is not None:
            return Enqueued(409, run, str(IdempotencyConflict(run, difference)), tuple(difference))
    return Enqueued(200, run)


def _audit_created(actor: Actor, runs: list[Run], triggered: bool) -> None:
    """One event per job: the run itself when it is one, else the count and the first ids. A
    job run now by a person or a client (`job.trigger`) is an event of the job, naming the run:
    the job's history shows it."""
    by_job: dict[int, list[Run]] = {}
    for run in runs:
        by_job.setdefault(run.definition_id, []).append(run)
    for group in by_job.values():
        first = group[0]
        if triggered:
            after = {"runIds": [run.run_id for run in group[:TARGETS_SHOWN]]}
            if len(group) > 1:
                after["count"] = len(group)
            name = first.definition.name
            record(
                actor, "job.trigger", team=first.team, target_type="job", target=name, after=after
            )
            continue
        if len(group) == 1:
            after = {
                "job": first.definition.name,
                "idempotencyKey": first.idempotency_key,
                "dueAt": format_utc(first.due_at),
            }
            target = first.run_id
        else:
            after = {
                "job": first.definition.name,
                "count": len(group),
                "runIds": [run.run_id for run in group[:TARGETS_SHOWN]],
            }
            target = f"{len(group)} runs"
        record(actor, "run.create", team=first.team, target_type="run", target=target, after=after)


def create_run(
    definition: JobDefinition,
    actor: Actor,
    *,
    idempotency_key: str | None,
    delay_seconds: int | None = None,
    run_at: datetime | None = None,
    payload: Any = None,
    trigger: str = Trigger.API,
    triggered: bool = False,
) -> Created:
    """Create one delayed, one-off or immediate run: a batch of one (enqueue_many).
    `triggered`: the job run now on request (audited as `job.trigger`, whatever `trigger`)."""
    wanted = Wanted(definition.name, idempotency_key, delay_seconds, run_at, payload)
    batch = enqueue_many(
        [definition.team_id], [wanted], actor, trigger=trigger, triggered=triggered
    )
    (answer,) = batch.answers
    if answer.status == 409:
        raise IdempotencyConflict(answer.run, list(answer.fields))
    if answer.status == 404:  # deleted by another client since it was read
        raise DefinitionGone(definition.name)
    if answer.status == 503:
        raise shards.Unavailable([str(definition.shard)])
    return Created(answer.run, answer.status == 201)
