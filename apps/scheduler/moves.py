"""Moving one shard to another database (`manage.py moveshard N --to URL`), in a maintenance
window, with nothing lost or duplicated.

1. Connect to the target and migrate it; refuse a target that already holds rows of the shard
   (but for a copy a move of the shard that died left there: it is deleted).
2. Take the shard's scheduler lease (a new epoch: the node that held it can no longer write for
   it), mark the shard `moving` to the target in the control database (every process refuses
   its new runs and definition changes within `shards.REFRESH_SECONDS`), and put a guard on the
   source's tables (an INSERT trigger, apps/runs/migrations/0022) that refuses new rows of the
   shard outright (a process with an older map). Existing rows are written as usual: leased
   runs complete, heartbeat and are reaped, and claims that meet the shard's waiting runs lease
   them until step 3 locks them.
3. In one transaction on the source: lock (FOR SHARE) every row of the shard that is not
   leased, again and again until none is leased. Claims pass locked runs by (SKIP LOCKED);
   leased runs finish or expire as usual meanwhile. Past `wait` seconds with runs still leased,
   the move is refused and undone, naming them.
4. Copy definitions, runs, attempts and rate-window starts (COPY, binary) into one
   transaction on the target, with fencing tokens lifted above the target's own (monotonic per
   run, as before), compare the row counts and an MD5 checksum of every copied row on both
   sides, and commit the target. No claim leases the copy: a claim leases only the shards the
   map places in its database (`shards.claimed_here`).
5. Freeze the shard's runs on the source (an UPDATE trigger, apps/runs/migrations/0026, that
   leaves each row as it is), in a session of its own: from here the copy is the shard's, and
   should the move die, its rows on the source are never leased again.
6. Point the shard at the target in the control database (the map's override,
   `ShardPlacement`), with claims of it there held for two map refreshes (`settles_at`), and
   give the scheduler lease back. Meanwhile a process that has not read the map yet still
   reads the shard's rows on the source (the locks hold them unchanged), and a result it takes
   for a run leased from the target cannot come: none is. Then delete the shard's rows from the
   source, commit it and lift the freeze. The INSERT guard stays on the source while the shard
   is away.

A move holds a session lock on the shard in the control database from start to end: a second
move of the shard is refused while it runs, and the lock goes with the move's session if the
process dies. A move that died (killed, or its undo could not reach a database) is cleared by
running the command again, and `scheduler_shard_move_unfinished` says so meanwhile
(`ShardPlacement.moving_to` and `moving_from` name its databases): before its flip it left a
copy on its target, deleted then; after, the rows its source kept, deleted then. The command
then does what it is asked: `--to` where the shard lives releases it (its `moving` mark, the
dead move's scheduler lease, the source's guard), `--to` another database moves it there.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlparse

import psycopg
from django.conf import settings
from django.core.management import call_command
from django.db import OperationalError, connections, transaction
from django.db.models import Q
from psycopg import sql as psql

from apps.runs import shards
from apps.runs.ids import public_run_id
from apps.runs.models import ShardPlacement
from apps.runs.shards import FROZEN_PREFIX, MOVED_GUARD_PREFIX

SHARDED_TABLES = ("jobs_jobdefinition", "runs_run")
log = logging.getLogger(__name__)


# --- the statements, in the order the move runs them ----------------------------------------

# 0. In the control database, for the whole move: one move of a shard at a time. A session lock,
#    so a move that dies lets go of it with its connection.
LOCK_MOVE = "SELECT pg_try_advisory_lock(%(space)s, %(shard)s)"
UNLOCK_MOVE = "SELECT pg_advisory_unlock(%(space)s, %(shard)s)"
MOVE_LOCKS = 0x6D6F7665  # "move": the lock space of moves, the shard the key within it

#    The source's session, seen from the target's: the same server and database under another
#    URL (`localhost` for `127.0.0.1`, say), which must not be taken for a target.
# The other session's process id and start: a pid alone may be another server's too.
SAME_DATABASE = """
SELECT EXISTS (SELECT 1 FROM pg_stat_activity
               WHERE pid = %(pid)s AND backend_start = %(started)s
                 AND datname = current_database())
"""
THIS_SESSION = "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"

# 1. On the target: rows of the shard already there (a leftover of another move) refuse it.
TARGET_HOLDS = "SELECT EXISTS (SELECT 1 FROM {table} WHERE shard = %(shard)s)"

# 2. In the control database: the scheduler lease taken with a new epoch, an hour long (a
#    materialiser holding the row FOR SHARE is waited for: its batch commits first).
TAKE_LEASE = """
INSERT INTO scheduler_shardlease (shard, owner, epoch, expires_at)
VALUES (%(shard)s, %(owner)s, 1, now() + interval '1 hour')
ON CONFLICT (shard) DO UPDATE
SET owner = EXCLUDED.owner, epoch = scheduler_shardlease.epoch + 1,
    expires_at = EXCLUDED.expires_at
"""
GIVE_LEASE = """
UPDATE scheduler_shardlease SET owner = '', expires_at = now() - interval '1 second'
WHERE shard = %(shard)s AND owner = %(owner)s
"""
#    The shards a move has marked and no move holds (LOCK_MOVE): moves that died, which the
#    command finishes or undoes when run again (scheduler_shard_move_unfinished).
UNFINISHED = """
SELECT p.shard FROM runs_shardplacement p
WHERE (p.moving OR p.moving_to <> '')
  AND NOT EXISTS (
      SELECT 1 FROM pg_locks l
      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND l.classid = %(space)s AND l.objid = p.shard)
ORDER BY p.shard
"""
#    A dead move's lease (its owner names a move; no move runs: the caller holds LOCK_MOVE).
GIVE_DEAD_MOVES_LEASE = """
UPDATE scheduler_shardlease SET owner = '', expires_at = now() - interval '1 second'
WHERE shard = %(shard)s AND owner LIKE 'moveshard:%%'
"""
#    On the source (and dropped on the target, where a shard that comes back may have left one):
#    inserts of the shard's rows refused, as check_violation named after the guard. Not a CHECK
#    constraint, which would refuse every update of the shard's rows too.
ADD_GUARD = (
    "CREATE TRIGGER {name} BEFORE INSERT ON {table} FOR EACH ROW WHEN (NEW.shard = {shard})"
    " EXECUTE FUNCTION shard_moved_refuse()"
)
DROP_GUARD = "DROP TRIGGER IF EXISTS {name} ON {table}"
GUARDED = """
SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = %(name)s AND tgrelid = %(table)s::regclass)
"""
#    The freeze (step 5): updates of the shard's runs leave them as they are, claims included
#    (the claim leases the other runs it met). Deletes are not held: the move's own, and the
#    clean-up of a move that died, delete the frozen rows.
FREEZE = (
    "CREATE TRIGGER {name} BEFORE UPDATE ON runs_run FOR EACH ROW WHEN (OLD.shard = {shard})"
    " EXECUTE FUNCTION shard_frozen_skip()"
)
THAW = "DROP TRIGGER IF EXISTS {name} ON runs_run"
#    Every change of a table's triggers waits for the sessions using the table, and every
#    statement on it waits behind that change: a session left open in a transaction would stall
#    the claims for as long as it stays open. So each waits half a second at most, and is tried
#    again half a second later, ten seconds in all, before the move gives up (undone). The
#    freeze is taken in a session of its own while the move's transaction holds the shard's
#    rows: a session that waits for those rows (a retention round deleting some) holds the lock
#    the trigger waits for, a wait no server sees as a deadlock.
DDL_LOCK_WAIT = "SET LOCAL lock_timeout = '500ms'"
DDL_TRIES = 20

# 3. On the source. No index leads with the shard: each pass reads the runs table once, which
#    the maintenance window pays for.
LOCK_IDLE_RUNS = """
SELECT count(*) FROM (
    SELECT id FROM runs_run WHERE shard = %(shard)s AND state <> 'leased' FOR SHARE
) AS locked
"""
LOCK_DEFINITIONS = """
SELECT count(*) FROM (SELECT id FROM jobs_jobdefinition WHERE shard = %(shard)s FOR SHARE) AS d
"""
LEASED = "SELECT id FROM runs_run WHERE shard = %(shard)s AND state = 'leased' ORDER BY id"

# 4. The rows of the shard, as copied and as compared: the same expressions on both sides (on
#    the source with the fencing tokens lifted, `{lift}`), ordered so that the checksum is one.
#    Attempts keep everything but their own key, which the target's sequence gives.
SELECTS = {
    "jobs_jobdefinition": "SELECT {columns} FROM jobs_jobdefinition WHERE shard = %(shard)s",
    "runs_run": "SELECT {columns} FROM runs_run WHERE shard = %(shard)s",
    "runs_attempt": (
        "SELECT {columns} FROM runs_attempt"
        " WHERE run_id IN (SELECT id FROM runs_run WHERE shard = %(shard)s)"
    ),
    # The rate windows' starts: a rate limit holds across the move.
    "runs_ratestart": (
        "SELECT {columns} FROM runs_ratestart"
        " WHERE definition_id IN (SELECT id FROM jobs_jobdefinition WHERE shard = %(shard)s)"
    ),
}
ORDER = {
    "jobs_jobdefinition": "id",
    "runs_run": "id",
    "runs_attempt": "run_id, number",
    "runs_ratestart": "definition_id, started_at",
}
CHECKSUM = """
SELECT count(*), coalesce(md5(string_agg(r::text, '|' ORDER BY {order})), '')
FROM ({select}) AS r
"""
COLUMNS = """
SELECT column_name FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name = %s ORDER BY ordinal_position
"""
#    The copied fencing tokens go up by `lift`, into a range of the target's token sequence
#    that the statement below takes for them: the sequence jumps past it at once. A sequence
#    cannot be moved atomically against other sessions' nextval, so the range starts a
#    million past the value read (far more than the claims of one statement's duration).
HIGHEST_TOKEN = """
SELECT coalesce(max(a.fencing_token), 0) FROM runs_attempt a
JOIN runs_run r ON r.id = a.run_id WHERE r.shard = %(shard)s
"""
RESERVE_TOKENS = """
SELECT setval('runs_fencing_token', nextval('runs_fencing_token') + 1000000 + %(span)s)
       - %(span)s
"""
#    After the copy, the target's keys: a new run or definition of the shard gets a key past
#    the copied ones (keys are sequence × 1024 + shard: apps/runs/shards.py).
RAISE_SEQUENCE = """
SELECT setval(%(sequence)s, greatest(nextval(%(sequence)s) + 1000000, %(at_least)s))
"""
HIGHEST_KEY = {
    "runs_run_id_seq": "SELECT coalesce(max(id), 0) / 1024 + 1 FROM runs_run",
    "jobs_jobdefinition_id_seq": "SELECT coalesce(max(id), 0) / 1024 + 1 FROM jobs_jobdefinition",
}

# 5. On the source, in the transaction that holds the locks.
DELETE_SHARD = """
WITH runs AS (SELECT id FROM runs_run WHERE shard = %(shard)s),
attempts AS (DELETE FROM runs_attempt WHERE run_id IN (SELECT id FROM runs))
DELETE FROM runs_run WHERE id IN (SELECT id FROM runs)
"""
DELETE_DEFINITIONS = """
WITH definitions AS (SELECT id FROM jobs_jobdefinition WHERE shard = %(shard)s),
starts AS (DELETE FROM runs_ratestart WHERE definition_id IN (SELECT id FROM definitions))
DELETE FROM jobs_jobdefinition WHERE id IN (SELECT id FROM definitions)
"""

COPIED_TABLES = ("jobs_jobdefinition", "runs_run", "runs_attempt", "runs_ratestart")
# Tables whose own key the target's sequence gives (nothing refers to it).
FRESH_KEYS = ("runs_attempt", "runs_ratestart")


class MoveError(Exception):
    """The move was refused or failed; nothing changed where the shard is."""


@dataclass
class Moved:
    shard: int
    source: str  # the shards' span of the source database before the move, e.g. "0-7"
    rows: dict[str, int] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)
    waited: float = 0.0  # seconds spent waiting for leased runs
    finished_only: bool = False  # an interrupted move's clean-up


def move(
    shard: int, url: str, *, wait: float = 300.0, say: Callable[[str], None] = lambda _: None
) -> Moved:
    """Move `shard` to the database at `url` (see the module's steps). MoveError when it is
    refused or fails (undone); a database that cannot be reached is one too."""
    shards.refresh(force=True)
    if not 0 <= shard < settings.SCHEDULER_SHARD_COUNT:
        raise MoveError(f"There is no shard {shard}.")
    if not urlparse(url).path.strip("/"):
        raise MoveError("The target URL names no database (postgresql://HOST/DATABASE).")
    try:
        with _one_move(shard):
            return _move(shard, url, wait, say)
    except shards.DOWN as exc:
        what = "cannot be reached" if shards.down(exc) else "refused a commit"
        raise MoveError(
            f"A database of the move {what} ({str(exc).strip()}). Once that is resolved,"
            f" if shard {shard} refuses new runs, run this command with --to the URL of the"
            " database it is in: that releases it."
        ) from exc


@contextmanager
def _one_move(shard: int) -> Iterator[None]:
    """Hold the shard's move lock (LOCK_MOVE) for the block; MoveError if another move has it."""
    params = {"space": MOVE_LOCKS, "shard": shard}
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(LOCK_MOVE, params)
        if not cursor.fetchone()[0]:
            raise MoveError(f"Another move of shard {shard} is under way.")
    try:
        yield
    finally:
        with connections[shards.CONTROL].cursor() as cursor:
            cursor.execute(UNLOCK_MOVE, params)


def _same_database(alias: str, other: str) -> bool:
    """Whether two aliases reach the same database (whatever their URLs say): `other`'s
    session is seen from `alias` in its own database."""
    with connections[other].cursor() as cursor:
        cursor.execute(THIS_SESSION)
        pid, started = cursor.fetchone()
    with connections[alias].cursor() as cursor:
        cursor.execute(SAME_DATABASE, {"pid": pid, "started": started})
        return bool(cursor.fetchone()[0])


def _move(shard: int, url: str, wait: float, say: Callable[[str], None]) -> Moved:
    target = shards.connect(url)
    source = shards.alias_of_shard(shard)
    if source == target:
        return _finish(shard, target, say)
    if _same_database(target, source):
        raise MoveError(
            f"The target is the database shard {shard} lives in, under another URL:"
            " nothing to move."
        )
    # Another database of the map under another spelling (`localhost` for `127.0.0.1`) was
    # taken for a new one: its jobs were listed twice, and the same command run again took
    # the shard for a leftover there and deleted it.
    for known in dict.fromkeys([shards.CONTROL, *shards.databases()]):
        if known not in (source, target) and _same_database(target, known):
            raise MoveError(
                f"The target is the database of shards {shards.span(known) or 'none'} under "
                "another URL: give it as the map does (SCHEDULER_SHARD_DATABASES, or "
                "DATABASE_URL for the control database)."
            )
    say(f"migrating the target database ({target})")
    call_command("migrate", database=target, interactive=False, verbosity=0)
    if _clear_dead_move(shard, source, say):
        _release(shard, source)
    for table in SHARDED_TABLES:
        with connections[target].cursor() as cursor:
            cursor.execute(TARGET_HOLDS.format(table=table), {"shard": shard})
            if cursor.fetchone()[0]:
                raise MoveError(
                    f"The target already holds rows of shard {shard} in {table}: delete them"
                    " or choose another database."
                )
    owner = f"moveshard:{socket.gethostname()}:{os.getpid()}"
    report = Moved(shard, shards.span(source))
    say(f"taking shard {shard}'s scheduler lease and refusing its new runs")
    copied = False
    try:
        _begin(shard, (url, shards.url_of(source)), owner, source, target)
        time.sleep(2 * shards.REFRESH_SECONDS)  # every process has seen `moving`
        with transaction.atomic(using=source):
            report.waited = _lock(shard, source, wait, say)
            say(f"copying shard {shard}")
            with transaction.atomic(using=target):
                _copy(shard, source, target, report)
            copied = True
            say(f"rows {report.rows}, checksums equal")
            _freeze(shard, source)
            say(f"pointing shard {shard} at the target")
            _flip(shard, url, owner)
            # Until every process has read the map, those that have not read the shard's rows
            # here, as the locks hold them: a 404 otherwise.
            time.sleep(2 * shards.REFRESH_SECONDS)
            with connections[source].cursor() as cursor:
                cursor.execute(DELETE_SHARD, {"shard": shard})
                cursor.execute(DELETE_DEFINITIONS, {"shard": shard})
        _thaw(shard, source)
        _done(shard)
    except BaseException as exc:
        if _undo(shard, owner, source, target, copied=copied):
            raise
        raise MoveError(
            f"Shard {shard} lives in {target} now, but the move could not finish"
            f" ({str(exc).strip() or type(exc).__name__}): run this command again to finish it."
        ) from exc
    shards.refresh(force=True)
    say(f"shard {shard} now lives in {target}; its rows left the source")
    return report


def _begin(shard: int, urls: tuple[str, str], owner: str, source: str, target: str) -> None:
    """Step 2: the lease, the marks (`urls`: the target's and the source's) and the guard."""
    to, from_ = urls
    with transaction.atomic(using=shards.CONTROL), connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(TAKE_LEASE, {"shard": shard, "owner": owner})
        ShardPlacement.objects.using(shards.CONTROL).update_or_create(
            shard=shard, defaults={"moving": True, "moving_to": to, "moving_from": from_}
        )
    name = f"{MOVED_GUARD_PREFIX}{shard}"
    for table in SHARDED_TABLES:
        _ddl(target, DROP_GUARD.format(table=table, name=name))
        _ddl(
            source,
            DROP_GUARD.format(table=table, name=name),
            ADD_GUARD.format(table=table, name=name, shard=int(shard)),
        )
    # A freeze a move of the shard away from the target left there once (it came back).
    _thaw(shard, target)


def _lock(shard: int, source: str, wait: float, say: Callable[[str], None]) -> float:
    """Lock every row of the shard that is not leased until none is; return the seconds it
    took. Raise MoveError when runs are still leased after `wait` seconds."""
    started = time.monotonic()
    with connections[source].cursor() as cursor:
        cursor.execute(LOCK_DEFINITIONS, {"shard": shard})
        quiet = 0
        while True:
            cursor.execute(LOCK_IDLE_RUNS, {"shard": shard})
            cursor.execute(LEASED, {"shard": shard})
            leased = [row[0] for row in cursor.fetchall()]
            # Twice in a row with none leased: a run that finished between the lock and the
            # count is locked by the second pass.
            quiet = quiet + 1 if not leased else 0
            if quiet == 2:
                return time.monotonic() - started
            waited = time.monotonic() - started
            if leased and waited > wait:
                named = ", ".join(public_run_id(pk) for pk in leased[:10])
                raise MoveError(
                    f"{len(leased)} runs of shard {shard} are still leased after {wait:.0f} s"
                    f" ({named}{', …' if len(leased) > 10 else ''}); the move is undone."
                )
            if leased:
                say(f"waiting for {len(leased)} leased runs of shard {shard}")
                time.sleep(1.0)


def _copy(shard: int, source: str, target: str, report: Moved) -> None:
    """Copy the shard's rows into the target's open transaction and compare them."""
    with connections[source].cursor() as cursor:
        cursor.execute(HIGHEST_TOKEN, {"shard": shard})
        span = cursor.fetchone()[0]
    with connections[target].cursor() as cursor:
        cursor.execute(RESERVE_TOKENS, {"span": span})
        lift = cursor.fetchone()[0]
    for table in COPIED_TABLES:
        columns = _columns(source, table)
        if columns != _columns(target, table):
            raise MoveError(f"{table} differs between the databases: migrate both first.")
        if table in FRESH_KEYS:
            columns = [c for c in columns if c != "id"]
        lifted = ", ".join(
            f"{c} + {int(lift)} AS {c}" if c == "fencing_token" and table != "jobs_jobdefinition"
            else c
            for c in columns
        )  # fmt: skip
        params = {"shard": shard}
        out = SELECTS[table].format(columns=lifted)
        with connections[source].cursor() as read, connections[target].cursor() as write:
            # psycopg's COPY, on the connections (and in the transactions) of both databases.
            with (
                connections[source].connection.cursor() as raw_read,
                connections[target].connection.cursor() as raw_write,
                raw_read.copy(
                    f"COPY ({_inline(raw_read, out, params)}) TO STDOUT (FORMAT BINARY)"
                ) as source_copy,
                raw_write.copy(
                    f"COPY {table} ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)"
                ) as target_copy,
            ):
                for block in source_copy:
                    target_copy.write(block)
            read.execute(CHECKSUM.format(order=ORDER[table], select=out), params)
            sent = read.fetchone()
            write.execute(
                CHECKSUM.format(
                    order=ORDER[table], select=SELECTS[table].format(columns=", ".join(columns))
                ),
                params,
            )
            got = write.fetchone()
        if tuple(sent) != tuple(got):
            raise MoveError(
                f"{table}: {sent[0]} rows sent, {got[0]} arrived, checksums"
                f" {'equal' if sent[1] == got[1] else 'differ'}; the move is undone."
            )
        report.rows[table], report.checksums[table] = got
    with connections[target].cursor() as cursor:
        for sequence, highest in HIGHEST_KEY.items():
            cursor.execute(highest)
            cursor.execute(RAISE_SEQUENCE, {"sequence": sequence, "at_least": cursor.fetchone()[0]})


def _inline(cursor, sql: str, params: dict) -> str:
    """COPY takes no parameters: the statement with them bound (by psycopg, quoted)."""
    return (
        psql.SQL(sql.replace("%(shard)s", "{shard}"))
        .format(shard=psql.Literal(params["shard"]))
        .as_string(cursor.connection)
    )


def _columns(alias: str, table: str) -> list[str]:
    with connections[alias].cursor() as cursor:
        cursor.execute(COLUMNS, [table])
        return [row[0] for row in cursor.fetchall()]


def _flip(shard: int, url: str, owner: str) -> None:
    """Point the shard at the target, its claims there held for two map refreshes, and give
    its scheduler lease back, in one transaction."""
    settle = timedelta(seconds=2 * shards.REFRESH_SECONDS)
    with transaction.atomic(using=shards.CONTROL), connections[shards.CONTROL].cursor() as cursor:
        cursor.execute("SELECT now()")
        settles_at = cursor.fetchone()[0] + settle
        ShardPlacement.objects.using(shards.CONTROL).update_or_create(
            shard=shard, defaults={"url": url, "moving": False, "settles_at": settles_at}
        )
        cursor.execute(GIVE_LEASE, {"shard": shard, "owner": owner})


def _done(shard: int) -> None:
    """The move has nothing left anywhere: it is no longer unfinished."""
    ShardPlacement.objects.using(shards.CONTROL).filter(shard=shard).update(
        moving_to="", moving_from=""
    )


def _freeze(shard: int, alias: str) -> None:
    """Freeze the shard's runs in `alias` (FREEZE), committed at once, in a session of its own
    (the move's holds the rows)."""

    def freeze() -> None:
        try:
            _ddl(alias, FREEZE.format(name=f"{FROZEN_PREFIX}{shard}", shard=int(shard)))
        finally:
            connections[alias].close()

    _in_own_session(freeze)


def _thaw(shard: int, alias: str) -> bool:
    """Lift the shard's freeze in `alias`; whether there was one."""
    name = f"{FROZEN_PREFIX}{shard}"
    with connections[alias].cursor() as cursor:
        cursor.execute(GUARDED, {"name": name, "table": "runs_run"})
        if not cursor.fetchone()[0]:
            return False
    _ddl(alias, THAW.format(name=name))
    return True


def _ddl(alias: str, *statements: str) -> None:
    """Run `statements` in one transaction on `alias`, each lock waited for DDL_LOCK_WAIT at
    most, DDL_TRIES times; MoveError when the lock could not be had."""
    for attempt in range(DDL_TRIES):
        try:
            with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
                cursor.execute(DDL_LOCK_WAIT)
                for statement in statements:
                    cursor.execute(statement)
            return
        except OperationalError as exc:
            if not isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):
                raise
            log.warning("%s: %s (try %d of %d)", alias, exc, attempt + 1, DDL_TRIES)
            time.sleep(0.5)
    raise MoveError(
        f"A table of {alias} stayed locked by other sessions (one left open in a transaction?):"
        " the move could not change its triggers there."
    )


def _in_own_session(work: Callable[[], None]) -> None:
    """Run `work` on this process's connections of another thread (sessions of their own)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # raised again in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="moveshard-session")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def unfinished() -> list[int]:
    """The shards a move that died left marked (UNFINISHED): run the command again."""
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(UNFINISHED, {"space": MOVE_LOCKS})
        return [row[0] for row in cursor.fetchall()]


def _undo(shard: int, owner: str, source: str, target: str, *, copied: bool) -> bool:
    """After a refused or failed move: the shard stays where it was and takes new runs again.
    Once the control database places it on the target, only the clean-up is left, which
    running the move again does (`_finish`): False then. A database the undo cannot reach (the
    one whose failure ended the move, say) is left as it is: running the command again
    finishes or undoes the rest."""
    shards.refresh(force=True)
    if shards.alias_of_shard(shard) == target:
        return False
    copy_left = False
    if copied:  # the target committed its copy: nothing reads it there, and it goes
        try:
            _delete_shard(shard, target)
        except shards.DOWN:
            log.warning("the undo could not delete shard %d's copy on %s", shard, target)
            copy_left = True
    # A copy left keeps the move marked (`moving_to`): no claim leases it meanwhile, and the
    # command run again deletes it.
    _release(shard, source, owner, keep_target=copy_left)
    return True


def _delete_shard(shard: int, alias: str) -> tuple[int, int]:
    """Delete the shard's rows in `alias` and lift its freeze there: (runs, definitions)."""
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(DELETE_SHARD, {"shard": shard})
        runs = cursor.rowcount
        cursor.execute(DELETE_DEFINITIONS, {"shard": shard})
        definitions = cursor.rowcount
    _thaw(shard, alias)
    return runs, definitions


def _clear_dead_move(shard: int, home: str, say: Callable[[str], None]) -> bool:
    """Before the shard moves from `home`, where it lives, or is released there: delete what a
    move of it that died left elsewhere, and lift the freeze it left on `home` (the caller
    holds LOCK_MOVE: no move of the shard runs). Died before its flip, its copy on the target;
    after, the rows its source kept. Whether there was such a move."""
    placed = ShardPlacement.objects.using(shards.CONTROL).filter(shard=shard).first()
    if placed is None or not placed.moving_to:
        return _thaw(shard, home)
    copy = shards.connect(placed.moving_to)
    if copy != home:
        runs, definitions = _delete_shard(shard, copy)
        say(
            f"a move of shard {shard} to {copy} died before its flip: deleted its copy"
            f" ({runs} runs, {definitions} definitions)"
        )
    elif placed.moving_from and (kept := shards.connect(placed.moving_from)) != home:
        runs, definitions = _delete_shard(shard, kept)
        say(
            f"a move of shard {shard} died after its flip: deleted the {runs} runs and"
            f" {definitions} definitions its source ({kept}) kept"
        )
    _thaw(shard, home)
    return True


def _release(shard: int, home: str, owner: str | None = None, *, keep_target: bool = False) -> bool:
    """Let the shard take new runs in `home`, where it lives: the guard and the freeze off
    `home`, `moving` off, the move's scheduler lease given back (`owner`'s, or any dead move's).
    With `keep_target`, `moving_to` stays: the undo left a copy there, which the command run
    again deletes. Return whether there was anything to release. The guard goes first: while
    it is on, `moving` still tells every process to refuse the shard's new runs, rather than
    let the guard refuse them."""
    released = False
    try:
        for table in SHARDED_TABLES:
            with connections[home].cursor() as cursor:
                cursor.execute(GUARDED, {"name": f"{MOVED_GUARD_PREFIX}{shard}", "table": table})
                guarded = cursor.fetchone()[0]
            if guarded:
                released = True
                _ddl(home, DROP_GUARD.format(table=table, name=f"{MOVED_GUARD_PREFIX}{shard}"))
        released |= _thaw(shard, home)
    except shards.DOWN:
        log.warning("shard %d's guard is still on %s, which cannot be reached", shard, home)
        shards.refresh(force=True)
        raise
    with transaction.atomic(using=shards.CONTROL), connections[shards.CONTROL].cursor() as cursor:
        released |= bool(
            ShardPlacement.objects.using(shards.CONTROL)
            .filter(shard=shard)
            .filter(Q(moving=True) | ~Q(moving_to=""))
            .update(moving=False, **({} if keep_target else {"moving_to": "", "moving_from": ""}))
        )
        if owner is None:
            cursor.execute(GIVE_DEAD_MOVES_LEASE, {"shard": shard})
        else:
            cursor.execute(GIVE_LEASE, {"shard": shard, "owner": owner})
        released |= bool(cursor.rowcount)
    shards.refresh(force=True)
    return released


def _finish(shard: int, home: str, say: Callable[[str], None]) -> Moved:
    """The shard already lives in `home`: finish or undo what a move that died left (a copy
    on its target, the freeze and rows of the shard in a database it left, its marks)."""
    report = Moved(shard, shards.span(home), finished_only=True)
    died = _clear_dead_move(shard, home, say)
    for alias in shards.databases():
        if alias == home:
            continue
        runs, definitions = _delete_shard(shard, alias)
        if runs or definitions:
            say(f"deleted {runs} runs and {definitions} definitions left in {alias}")
    if _release(shard, home) or died:
        say(f"released shard {shard}: a move that did not finish had left it marked")
    say(f"shard {shard} lives in {home}")
    return report
