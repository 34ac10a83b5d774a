"""Where a shard's rows live: the one module that names database aliases.

Definitions, runs, attempts and their minute counts live in the database of their shard
(`settings.SHARD_MAP`, from `SCHEDULER_SHARD_DATABASES`); everything else (teams, tokens,
audit, shard leases, queue settings) in the control database, `default`. Unset, every shard is
on the control database and each alias below is `default`.

- `alias_of_shard(n)`, `databases()`, `shards_on(alias)`: the map; a shard moved by
  `manage.py moveshard` is placed by its row in the control database (`refresh`), and
  `moving()` names the shards being moved (their writes refused: `writable`, `Moving`).
- A run's id names its shard: ids are `sequence value × ID_SPACE + shard`, so
  `shard_of_run(id)` needs no lookup. The sequence is per database; ids of two databases
  never meet because their shards differ.
- `using(alias)`: the shard database that ORM queries of sharded models go to inside the
  block (the router below reads it), and `current()` and `cursor()` for raw SQL;
  `reaching`, `writing`, `writing_everywhere` and `gather` read and write one database or all
  of them, turning a database that is down into `Unavailable` or a named gap in a list.

Every database holds the same schema (`manage.py migrate` migrates each); rows of a kind are
only ever written to the database this module names.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
    connections,
    transaction,
)
from django.db.backends.utils import CursorWrapper
from django.db.models import QuerySet

from apps.audit.record import kept_with_rows
from scheduler_site import shardmap
from scheduler_site.database import CommitRefused, config_from_url
from scheduler_site.shardmap import ShardMap

# Shards a key of a run or definition can name: keys are a multiple of this plus the shard. The
# shard count may not exceed it (settings check it).
ID_SPACE = 1024

# The control database: teams, tokens, audit, shard leases, queue settings.
CONTROL = DEFAULT_DB_ALIAS

# Sharded models, as "app_label.model_name".
SHARDED = frozenset(
    {
        "jobs.jobdefinition",
        "runs.run",
        "runs.attempt",
        "runs.minutecounts",
        "runs.ratestart",
        "runs.census",
        "runs.failurecensus",
        # An audit event kept with the rows it is about (apps/audit/record.py).
        "audit.pendingevent",
    }
)

_current: ContextVar[str | None] = ContextVar("shard_database", default=None)

T = TypeVar("T")

# The shards found unavailable within a `noting` block (a dashboard request), for its banner.
_noted: ContextVar[set[str] | None] = ContextVar("unavailable_shards", default=None)

# What a shard database that is down raises; with every shard on the control database it is the
# control database's failure, and raised as before.
DOWN = (OperationalError, InterfaceError)
# For what reports on every database (readiness, metrics): one that answers but is not migrated
# (its tables missing) is as unreadable as one that is down.
UNREADABLE = (*DOWN, ProgrammingError)


def down(exc: BaseException) -> bool:
    """Whether a database error means its database is down or cannot be reached: DOWN's, but
    not a commit it refused (it answered: a CommitRefused is an OperationalError too)."""
    return isinstance(exc, DOWN) and not isinstance(exc, CommitRefused)


class Unavailable(Exception):
    """A shard database could not be reached; `spans` names its shards ("5-10")."""

    def __init__(self, spans: list[str]) -> None:
        self.spans = spans
        super().__init__(
            f"shards {', '.join(spans)} are unavailable (their database cannot be reached)"
        )


@dataclass(frozen=True)
class _Placement:
    map: ShardMap
    moving: frozenset[int] = frozenset()
    relocated: bool = False  # some shard lives away from the settings' map
    # A move marked some shard, which may have left a copy of it in another database.
    marked: bool = False
    settling: frozenset[int] = frozenset()  # moved a moment ago: not claimed yet


# The map this process routes by: the settings' until `refresh` reads the moved shards from the
# control database. Replaced whole, never changed in place (threads read it without a lock).
_placement: _Placement | None = None
_checked_at = -math.inf

# How stale a process's map may be: `manage.py moveshard` waits longer than this between
# refusing a shard's new runs and taking its rows, and every process refreshes at the start of
# a request and on each tick of the daemons.
REFRESH_SECONDS = 1.0

PLACEMENTS = """
SELECT shard, url, moving, coalesce(settles_at > now(), false), moving_to <> ''
FROM runs_shardplacement
"""

# The guard that keeps new rows of a moved shard out of the database it left, one per shard and
# table: an INSERT trigger `shard_moved_<N>` that raises check_violation under its own name, as
# a constraint would (apps/scheduler/moves.py).
MOVED_GUARD_PREFIX = "shard_moved_"
# The freeze a move puts on the shard's runs in the database it leaves, once their copy is
# committed: an UPDATE trigger `shard_frozen_<N>` that leaves each row as it is.
FROZEN_PREFIX = "shard_frozen_"


def moving_detail(shard: int) -> str:
    """What a request that would write a row of a shard being moved is told (503)."""
    return f"shard {shard} is moving to another database; try again in a minute"


def _current_map() -> ShardMap:
    return _placement.map if _placement is not None else settings.SHARD_MAP


def refresh(*, force: bool = False) -> None:
    """Read the moved shards from the control database (at most once a second unless
    `force`) and route by them. A control database that cannot be read keeps the last map."""
    global _checked_at, _placement
    now = time.monotonic()
    if not force and now - _checked_at < REFRESH_SECONDS:
        return
    _checked_at = now
    try:
        with connections[CONTROL].cursor() as cursor:
            cursor.execute(PLACEMENTS)
            rows = cursor.fetchall()
    except Exception:  # noqa: BLE001 - never fails the request or tick that asked
        # Before its migration, with the control database down, or where no database may be
        # used (a test without one): the last map stays.
        return
    base: ShardMap = settings.SHARD_MAP
    moved = {shard: url for shard, url, *_ in rows if url and shard < len(base.aliases)}
    placement = _Placement(
        shardmap.relocated(base, moved, settings.DATABASE_URL) if moved else base,
        moving=frozenset(shard for shard, _, moving, *_ in rows if moving),
        relocated=bool(moved),
        marked=any(marked for *_, marked in rows),
        settling=frozenset(shard for shard, _, _, settling, _ in rows if settling),
    )
    for alias, url in placement.map.urls.items():
        if alias not in connections.settings:
            _register(alias, url)
    _placement = placement


def connect(url: str) -> str:
    """The alias of the database at `url`: one the map names, else one made for it."""
    current = _current_map()
    known = {settings.DATABASE_URL.strip(): CONTROL, **{u: a for a, u in current.urls.items()}}
    if url in known:
        return known[url]
    alias = shardmap.moved_alias(url)
    if alias not in connections.settings:
        _register(alias, url)
    return alias


def url_of(alias: str) -> str:
    """The URL of a database this process reaches, as its map (or DATABASE_URL) gives it."""
    return settings.DATABASE_URL.strip() if alias == CONTROL else _current_map().urls[alias]


def _register(alias: str, url: str) -> None:
    """Make a Django connection alias for a database a shard moved to."""
    template = settings.DATABASES[CONTROL]
    config = config_from_url(
        url,
        application_name=template["OPTIONS"].get("application_name", "scheduler"),
        **settings.DB_CONNECTION,
    )
    # Django fills in the defaults of a set of databases that holds `default` (5.2 refuses one
    # without it, which made every move to a database outside the map fail).
    databases = {CONTROL: settings.DATABASES[CONTROL], alias: config}
    config = connections.configure_settings(databases)[alias]
    settings.DATABASES[alias] = config
    connections.settings[alias] = config


def ever_moved() -> bool:
    """Whether any shard has been moved or is moving (its old database then holds a guard), or
    a move that did not finish may have left a copy of one."""
    return _placement is not None and (
        _placement.relocated or bool(_placement.moving) or _placement.marked
    )


def claimed_here(alias: str) -> list[int] | None:
    """The shards whose runs a claim on `alias` may lease: those the map places there, but for
    one moved there a moment ago (`settles_at`). None, for every shard, while no shard has
    been moved. A database a shard left may hold its rows still (a move that died after its
    flip): they are the old copy, and leasing them there would run them twice."""
    if not ever_moved():
        return None
    aliases = _current_map().aliases
    settling = _placement.settling if _placement is not None else frozenset()
    return [s for s, where in enumerate(aliases) if where == alias and s not in settling]


def moving() -> frozenset[int]:
    """The shards being moved (`manage.py moveshard`): their new runs are refused meanwhile."""
    return _placement.moving if _placement is not None else frozenset()


class Moving(Unavailable):
    """A row of a shard being moved was to be written (`manage.py moveshard`)."""

    def __init__(self, shard: int) -> None:
        self.spans = [str(shard)]
        Exception.__init__(self, moving_detail(shard))


def writable(shard: int) -> str:
    """The database of `shard` for a write by a person or a client; raises `Moving` while the
    shard is being moved (its rows are about to leave that database)."""
    if shard in moving():
        raise Moving(shard)
    return alias_of_shard(shard)


def alias_of_shard(shard: int) -> str:
    return _current_map().aliases[shard]


def current_map() -> ShardMap:
    """Where each shard is, as this process last read it (`refresh`)."""
    return _current_map()


def databases() -> list[str]:
    """Every database that holds shards, in the order of their first shard."""
    return list(dict.fromkeys(_current_map().aliases))


def shards_on(alias: str) -> list[int]:
    return [n for n, held in enumerate(_current_map().aliases) if held == alias]


def span(alias: str) -> str:
    """The shards of a database as people read them: "5-10", "3" alone, or "0-5,7" once moves
    have left gaps."""
    return shardmap.ranges(shards_on(alias))


def physical() -> bool:
    """Whether some shard lives outside the control database."""
    return _current_map().physical


def shard_of_run(run_pk: int) -> int:
    return run_pk % ID_SPACE


def alias_of_run(run_pk: int) -> str:
    shard = shard_of_run(run_pk)
    aliases = _current_map().aliases
    # An id from before runs named their shard (or a forged one) is looked for in the control
    # database's shards, where such runs were made.
    return aliases[shard] if shard < len(aliases) else CONTROL


def runs_by_database(run_ids: Sequence[int]) -> dict[str, list[int]]:
    """Run ids grouped by the database of their shard, in their order."""
    if not physical():
        return {_current_map().aliases[0]: list(run_ids)}
    groups: dict[str, list[int]] = {}
    for run_id in run_ids:
        groups.setdefault(alias_of_run(run_id), []).append(run_id)
    return groups


def with_teams(queryset: QuerySet) -> list:
    """The rows of a query of a sharded model with their `team`: joined where the teams are in
    the same database, else read from the control database in one more query."""
    if not physical():
        return list(queryset.select_related("team"))
    rows = list(queryset)
    teams = teams_by_id({row.team_id for row in rows})
    for row in rows:
        if row.team_id in teams:  # a team deleted meanwhile: its rows go with it
            row.team = teams[row.team_id]
    return rows


def teams_by_id(team_ids: set[int]) -> dict:
    """The teams of these ids, from the control database."""
    from apps.teams.models import Team

    return Team.objects.using(CONTROL).in_bulk(team_ids) if team_ids else {}


def next_id(model: type, shard: int) -> int:
    """A new primary key for a row of `shard` of a sharded model (a definition, or a run made
    through the ORM; the store's insert computes the same in SQL): its database's sequence
    value × ID_SPACE + shard, so the key names its shard and two databases' keys never meet."""
    with connections[alias_of_shard(shard)].cursor() as cursor:
        cursor.execute(
            "SELECT nextval(pg_get_serial_sequence(%s, 'id')) * %s + %s",
            [model._meta.db_table, ID_SPACE, shard],
        )
        return cursor.fetchone()[0]


def current() -> str:
    """The shard database of the enclosing `using` block (else the first one)."""
    return _current.get() or _current_map().aliases[0]


@contextmanager
def using(alias: str) -> Iterator[str]:
    token = _current.set(alias)
    try:
        yield alias
    finally:
        _current.reset(token)


def cursor() -> CursorWrapper:
    """A cursor on the current shard database."""
    return connections[current()].cursor()


@contextmanager
def reaching(alias: str) -> Iterator[str]:
    """`using(alias)`, where a shard database of its own that cannot be reached raises
    `Unavailable` naming its shards (the API answers 503, the dashboard says so)."""
    try:
        with using(alias):
            yield alias
    except DOWN as exc:
        if alias == CONTROL or not down(exc):
            raise  # a database that refused a commit answered: it is not unavailable
        raise Unavailable([span(alias)]) from exc


@contextmanager
def writing(alias: str) -> Iterator[str]:
    """A transaction on the shard database `alias` inside one on the control database, with
    `alias` current: audit events written inside commit with the shard's rows, in the same
    database's transaction (`kept_with_rows`); a shard database of its own commits its rows
    first (one transaction per database, never across)."""
    with (
        kept_with_rows(),
        transaction.atomic(using=CONTROL),
        reaching(alias),
        transaction.atomic(using=alias),
    ):
        yield alias


class PartlyCommitted(OperationalError):
    """A database failed at its commit after others had committed (`writing_everywhere`):
    `committed` names those, `failed` the one that failed; the rest were rolled back. A
    database error still (a caller that does not look at it answers as for one)."""

    def __init__(self, committed: list[str], failed: str) -> None:
        self.committed = committed
        self.failed = failed
        super().__init__(
            f"database {failed} failed at its commit after {', '.join(committed)} had committed"
        )


@contextmanager
def writing_everywhere() -> Iterator[None]:
    """One transaction on the control database and one on each shard database, committed at the
    end of the block, the shard databases first. Not two-phase: a database that fails at
    commit leaves those before it committed, and raises PartlyCommitted saying which (from the
    database's error); the audit events of their rows committed with them (`kept_with_rows`:
    those written while the rows' database is current)."""
    committed: list[str] = []
    failing: list[str] = []

    @contextmanager
    def committing(alias: str) -> Iterator[None]:
        failing.append(alias)  # until its commit is through
        with transaction.atomic(using=alias):
            yield
        failing.remove(alias)
        committed.append(alias)

    try:
        with ExitStack() as stack:
            stack.enter_context(kept_with_rows())
            stack.enter_context(committing(CONTROL))
            for alias in databases():
                if alias == CONTROL:  # in the transaction above
                    continue
                with reaching(alias):  # opening the transaction connects
                    stack.enter_context(committing(alias))
            yield
    except DatabaseError as exc:
        if not committed:
            raise
        # The commits run from the last database entered back to the first: the one that
        # failed is the last of those still waiting for theirs.
        raise PartlyCommitted(committed, failing[-1]) from exc


def gather(read: Callable[[], T], *, strict: bool = False) -> tuple[list[T], list[str]]:
    """`read()` on every shard database (current inside it), and the shards ("5-10") of the
    databases that could not be read: a list or count across shards shows those as unavailable
    rather than failing. `strict` raises `Unavailable` instead (what must see every shard)."""
    results: list[T] = []
    unavailable: list[str] = []
    for alias in databases():
        try:
            with using(alias):
                results.append(read())
        except DOWN:
            if not physical():
                raise
            unavailable.append(span(alias))
    if strict and unavailable:
        raise Unavailable(unavailable)
    noted = _noted.get()
    if noted is not None:
        noted.update(unavailable)
    return results, unavailable


@contextmanager
def noting() -> Iterator[set[str]]:
    """Collect the shards that every `gather` of the block found unavailable (a page shows
    them once, whichever of its reads missed them)."""
    noted: set[str] = set()
    token = _noted.set(noted)
    try:
        yield noted
    finally:
        _noted.reset(token)


def noted() -> list[str]:
    """The shards found unavailable so far in the enclosing `noting` block, in shard order."""
    return sorted(_noted.get() or (), key=lambda spans: int(spans.split("-")[0]))


class ShardRouter:
    """Django's database router: sharded models to the current shard database (an instance
    read from a database stays with it, as Django's own hint says), the rest to the control
    database."""

    def _route(self, model, **hints) -> str:
        if model._meta.label_lower not in SHARDED:
            # Said outright: Django would otherwise follow an instance's database, and a run's
            # team read from a run of a shard database must come from the control database.
            return CONTROL
        instance = hints.get("instance")
        if instance is not None and instance._state.db:
            return instance._state.db
        return current()

    db_for_read = _route
    db_for_write = _route

    def allow_relation(self, obj1, obj2, **hints) -> bool:
        # A run and its team live in different databases once shards are physical; the team is
        # read from the control database by its key.
        return True

    def allow_migrate(self, db: str, app_label: str, model_name: str | None = None, **hints):
        return True  # one schema everywhere
