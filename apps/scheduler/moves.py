"""Moving one shard to another database (`manage.py moveshard N --to URL`), in a maintenance
window, with nothing lost or duplicated.

1. Connect to the target and migrate it; refuse a target that already holds rows of the shard.
2. Take the shard's scheduler lease (a new epoch: the node that held it can no longer write for
   it), mark the shard `moving` in the control database (every process refuses its new runs
   and definition changes within `shards.REFRESH_SECONDS`), and put a guard on the source's
   tables (an INSERT trigger, apps/runs/migrations/0022) that refuses new rows of the shard
   outright (a process with an older map). Existing rows are written as usual: leased runs
   complete, heartbeat and are reaped, and claims that meet the shard's waiting runs lease them
   until step 3 locks them.
3. In one transaction on the source: lock (FOR SHARE) every row of the shard that is not
   leased, again and again until none is leased. Claims pass locked runs by (SKIP LOCKED);
   leased runs finish or expire as usual meanwhile. Past `wait` seconds with runs still leased,
   the move is refused and undone, naming them.
4. Copy definitions, runs, attempts and rate-window starts (COPY, binary) into one
   transaction on the target, with
   fencing tokens lifted above the target's own (monotonic per run, as before), and compare
   the row counts and an MD5 checksum of every copied row on both sides.
5. Commit the target, then point the shard at the target in the control database (the map's
   override, `ShardPlacement`) and give the scheduler lease back, then delete the shard's rows
   from the source and commit it. The guard stays on the source while the shard is away.

A move holds a session lock on the shard in the control database from start to end: a second
move of the shard is refused while it runs, and the lock goes with the move's session if the
process dies. An interrupted move is finished by running the same command again: once the
control database places the shard on the target, the command only deletes the shard's rows
elsewhere. A move that died before that (killed, or its undo could not reach a database) left
the shard refusing new runs: running the command with `--to` where the shard is releases it
(its `moving` mark, its scheduler lease and the source's guard).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlparse

from django.conf import settings
from django.core.management import call_command
from django.db import connections, transaction
from psycopg import sql as psql

from apps.runs import shards
from apps.runs.ids import public_run_id
from apps.runs.models import ShardPlacement
from apps.runs.shards import MOVED_GUARD_PREFIX

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
        raise MoveError(
            f"A database of the move cannot be reached ({str(exc).strip()}). Once it is back,"
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
        _begin(shard, owner, source, target)
        time.sleep(2 * shards.REFRESH_SECONDS)  # every process has seen `moving`
        with transaction.atomic(using=source):
            report.waited = _lock(shard, source, wait, say)
            say(f"copying shard {shard}")
            with transaction.atomic(using=target):
                _copy(shard, source, target, report)
            copied = True
            say(f"rows {report.rows}, checksums equal")
            _flip(shard, url, owner)
            with connections[source].cursor() as cursor:
                cursor.execute(DELETE_SHARD, {"shard": shard})
                cursor.execute(DELETE_DEFINITIONS, {"shard": shard})
    except BaseException:
        _undo(shard, owner, source, target, copied=copied)
        raise
    shards.refresh(force=True)
    say(f"shard {shard} now lives in {target}; its rows left the source")
    return report


def _begin(shard: int, owner: str, source: str, target: str) -> None:
    with transaction.atomic(using=shards.CONTROL), connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(TAKE_LEASE, {"shard": shard, "owner": owner})
        ShardPlacement.objects.using(shards.CONTROL).update_or_create(
            shard=shard, defaults={"moving": True}
        )
    for table in SHARDED_TABLES:
        name = f"{MOVED_GUARD_PREFIX}{shard}"
        with connections[target].cursor() as cursor:
            cursor.execute(DROP_GUARD.format(table=table, name=name))
        with connections[source].cursor() as cursor:
            cursor.execute(DROP_GUARD.format(table=table, name=name))
            cursor.execute(ADD_GUARD.format(table=table, name=name, shard=int(shard)))


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
    """Point the shard at the target and give its scheduler lease back, in one transaction."""
    with transaction.atomic(using=shards.CONTROL), connections[shards.CONTROL].cursor() as cursor:
        ShardPlacement.objects.using(shards.CONTROL).update_or_create(
            shard=shard, defaults={"url": url, "moving": False}
        )
        cursor.execute(GIVE_LEASE, {"shard": shard, "owner": owner})


def _undo(shard: int, owner: str, source: str, target: str, *, copied: bool) -> None:
    """After a refused or failed move: the shard stays where it was and takes new runs again.
    Once the control database places it on the target, only the source's clean-up is left,
    which running the move again does (`_finish`). A database the undo cannot reach (the one
    whose failure ended the move, say) is left as it is: running the command again with `--to`
    where the shard is releases the rest (`_release`)."""
    shards.refresh(force=True)
    if shards.alias_of_shard(shard) == target:
        return
    if copied:  # the target committed its copy: nothing reads it there, and it goes
        try:
            with transaction.atomic(using=target), connections[target].cursor() as cursor:
                cursor.execute(DELETE_SHARD, {"shard": shard})
                cursor.execute(DELETE_DEFINITIONS, {"shard": shard})
        except shards.DOWN:
            log.warning("the undo could not delete shard %d's copy on %s", shard, target)
    _release(shard, source, owner)


def _release(shard: int, home: str, owner: str | None = None) -> bool:
    """Let the shard take new runs in `home`, where it lives: the guard off `home`, `moving`
    off, the move's scheduler lease given back (`owner`'s, or any dead move's). Return whether
    there was anything to release. The guard goes first: while it is on, `moving` still tells
    every process to refuse the shard's new runs, rather than let the guard refuse them."""
    released = False
    try:
        for table in SHARDED_TABLES:
            with connections[home].cursor() as cursor:
                cursor.execute(GUARDED, {"name": f"{MOVED_GUARD_PREFIX}{shard}", "table": table})
                if cursor.fetchone()[0]:
                    released = True
                    cursor.execute(
                        DROP_GUARD.format(table=table, name=f"{MOVED_GUARD_PREFIX}{shard}")
                    )
    except shards.DOWN:
        log.warning("shard %d's guard is still on %s, which cannot be reached", shard, home)
        shards.refresh(force=True)
        raise
    with transaction.atomic(using=shards.CONTROL), connections[shards.CONTROL].cursor() as cursor:
        released |= bool(
            ShardPlacement.objects.using(shards.CONTROL)
            .filter(shard=shard, moving=True)
            .update(moving=False)
        )
        if owner is None:
            cursor.execute(GIVE_DEAD_MOVES_LEASE, {"shard": shard})
        else:
            cursor.execute(GIVE_LEASE, {"shard": shard, "owner": owner})
        released |= bool(cursor.rowcount)
    shards.refresh(force=True)
    return released


def _finish(shard: int, target: str, say: Callable[[str], None]) -> Moved:
    """The shard already lives in `target`: release what a move that died left on it, and
    delete what an interrupted move left elsewhere."""
    report = Moved(shard, shards.span(target), finished_only=True)
    if _release(shard, target):
        say(f"released shard {shard}: a move that did not finish had left it refusing new runs")
    for alias in shards.databases():
        if alias == target:
            continue
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(DELETE_SHARD, {"shard": shard})
            runs = cursor.rowcount
            cursor.execute(DELETE_DEFINITIONS, {"shard": shard})
            if runs or cursor.rowcount:
                say(f"deleted {runs} runs and {cursor.rowcount} definitions left in {alias}")
    say(f"shard {shard} lives in {target}")
    return report
