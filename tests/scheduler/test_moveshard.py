"""`manage.py moveshard`: one shard moves to another server while workers drain and producers
enqueue, and nothing is lost, duplicated or left behind."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from urllib.parse import urlparse, urlunparse

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connections, transaction

from apps.audit.record import Actor
from apps.jobs.enqueue import Wanted, enqueue_many
from apps.jobs.models import JobDefinition
from apps.jobs.schedule import shard_for
from apps.runs import shards, store
from apps.runs.models import RateStart, Run, ShardPlacement
from apps.runs.shards import FROZEN_PREFIX, MOVED_GUARD_PREFIX
from apps.scheduler import moves
from tests.conftest import (
    Drain,
    Layout,
    assert_invariants_everywhere,
    child_database_url,
    claim,
    db_now,
    manage,
    manage_started,
)
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.physical,
    pytest.mark.django_db(transaction=True, databases="__all__"),
]


@pytest.fixture
def placement_reset() -> Iterator[None]:
    """Moves outlive a test's rows (guards, the process's map): undone afterwards."""
    yield
    ShardPlacement.objects.using(shards.CONTROL).all().delete()
    for alias in shards.databases():
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT tgrelid::regclass::text, tgname FROM pg_trigger"
                " WHERE tgname LIKE %s OR tgname LIKE %s",
                [MOVED_GUARD_PREFIX + "%", FROZEN_PREFIX + "%"],
            )
            for table, name in cursor.fetchall():
                cursor.execute(f"DROP TRIGGER {name} ON {table}")
    shards.refresh(force=True)


def _names_of_shard(shard: int, count: int) -> list[str]:
    return [n for n in (f"move.{i}" for i in range(20_000)) if shard_for(n) == shard][:count]


def _job_of_shard(team, alias: str, shard: int) -> JobDefinition:
    with shards.using(alias):
        return JobDefinition.objects.create(
            team=team, name=_names_of_shard(shard, 1)[0], queue="q", timeout_seconds=600
        )


def test_a_shard_moves_under_load_with_nothing_lost_duplicated_or_left_behind(
    layout: Layout, team_a, placement_reset
):
    source, target = layout.aliases
    target_url = layout.servers[1].url
    shard = shards.shards_on(source)[0]
    moving_jobs = []
    for n, name in enumerate(_names_of_shard(shard, 2)):
        # The first is rate-limited (loosely: it must not hold the drain back), so its window's
        # starts move too.
        limit = {"rate_limit_count": 100_000, "rate_limit_period_seconds": 3600} if n == 0 else {}
        with shards.using(source):
            moving_jobs.append(
                JobDefinition.objects.create(
                    team=team_a, name=name, queue="q", timeout_seconds=60, **limit
                )
            )
    staying = layout.job_on(target, team_a, "stay")
    made: list[int] = []
    for job in [*moving_jobs, staying]:
        made += layout.new_runs(job, 150, "before")

    refused: list[str] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def producer() -> None:
        try:
            n = 0
            while not stop.is_set():
                n += 1
                items = [Wanted(job.name, f"during-{n}") for job in [*moving_jobs, staying]]
                answers = enqueue_many([team_a.pk], items, Actor.system()).answers
                assert {a.status for a in answers} <= {201, 503}, answers
                made.extend(a.run.pk for a in answers if a.status == 201)
                refused.extend(a.detail for a in answers if a.status == 503)
                time.sleep(0.05)
        except BaseException as exc:  # the test thread asserts on it
            failures.append(exc)
        finally:
            connections.close_all()

    making = threading.Thread(target=producer)
    # With a reaper, as in production. No worker call is refused during the move: claims pass
    # the shard's locked runs by, its leased runs complete.
    with Drain(team_a, 4, lease_seconds=3, reaper=True) as drain:
        making.start()
        try:
            time.sleep(1.0)  # under way: some runs leased, some done
            report = moves.move(shard, target_url, wait=60)
            time.sleep(1.0)  # producers enqueue to the shard's new database
        finally:
            stop.set()
            making.join(30)

    assert failures == []
    assert drain.failures == []
    assert report.rows["jobs_jobdefinition"] == len(moving_jobs)
    assert report.rows["runs_run"] >= 300
    assert report.rows["runs_attempt"] > 0
    rated = moving_jobs[0].pk
    assert report.rows["runs_ratestart"] > 0
    assert not RateStart.objects.using(source).filter(definition_id=rated).exists()
    assert (
        RateStart.objects.using(target).filter(definition_id=rated).count()
        >= report.rows["runs_ratestart"]
    )
    assert any(f"shard {shard} is moving" in detail for detail in refused)
    assert shards.alias_of_shard(shard) == target
    placed = ShardPlacement.objects.using(shards.CONTROL).get(shard=shard)
    assert (placed.url, placed.moving) == (target_url, False)

    # Nothing left behind, and every run made (before, during, after) is where its id says.
    for model in (Run, JobDefinition):
        assert not model.objects.using(source).filter(shard=shard).exists()
    where = {}
    for alias in shards.databases():
        where.update(dict.fromkeys(Run.objects.using(alias).values_list("pk", flat=True), alias))
    assert set(made) <= set(where)  # none lost
    assert all(where[pk] == shards.alias_of_run(pk) for pk in made)
    assert len(set(made)) == len(made)
    # The workers finished what they held; the rest drains where the runs now live, each
    # succeeding once.
    drain.drain_rest()
    assert set(drain.succeeded) >= set(made)
    assert all(count == 1 for count in drain.succeeded.values())
    for alias in shards.databases():
        states = set(Run.objects.using(alias).filter(pk__in=made).values_list("state", flat=True))
        assert states <= {"succeeded"}, (alias, states)
    assert_invariants_everywhere()


def test_during_a_move_leased_runs_finish_and_the_databases_other_shards_lease_as_usual(
    layout: Layout, team_a, placement_reset, monkeypatch
):
    """The move waits for the shard's leased runs: heartbeating, completing and failing them
    must work meanwhile, and claims on the same database must lease its other shards' runs
    (passing the moving shard's locked ones by), not fail."""
    source, target = layout.aliases
    shard, other = shards.shards_on(source)[:2]
    with shards.using(source):
        moving_job = JobDefinition.objects.create(
            team=team_a, name=_names_of_shard(shard, 1)[0], queue="q", timeout_seconds=600
        )
        staying_job = JobDefinition.objects.create(
            team=team_a, name=_names_of_shard(other, 1)[0], queue="q", timeout_seconds=600
        )
    layout.new_runs(moving_job, 3, "held")
    team = [team_a.pk]
    held = claim(queues=["q"], max_runs=3, worker_id="slow", lease_seconds=600, team_ids=team)
    assert len(held) == 3
    waiting = layout.new_runs(moving_job, 2, "waiting")
    staying = layout.new_runs(staying_job, 2, "staying")
    fresh = Run.objects.using(source).get(pk=waiting[0]).state

    said: list[str] = []
    moved: list[moves.Moved] = []

    def move() -> None:
        try:
            moved.append(moves.move(shard, layout.servers[1].url, wait=60, say=said.append))
        finally:
            connections.close_all()  # this thread's sessions, or the test databases stay in use

    mover = threading.Thread(target=move)
    mover.start()
    try:
        # Its guard is on and its passes have locked the shard's runs that are not leased.
        wait_for(lambda: any("waiting for 3 leased runs" in line for line in said), 20)
        beats = store.heartbeat([(held[0].id, held[0].fencing_token)], team_ids=team)
        done = store.complete([(held[0].id, held[0].fencing_token, None)], team_ids=team)
        error = {"message": "x", "type": "E"}
        failed = store.fail([(held[1].id, held[1].fencing_token, error, False)], team_ids=team)
        assert [o.status for o in beats + done + failed] == [200, 200, 200]
        taken = claim(queues=["q"], max_runs=10, worker_id="w", lease_seconds=60, team_ids=team)
        assert sorted(lease.id for lease in taken) == sorted(staying)
        # A process whose map is up to a second late to know of the move: its insert meets the
        # guard, and only the moving shard's item is refused; before, every item of the
        # batch bound for that database was.
        with monkeypatch.context() as late:
            late.setattr(shards, "moving", frozenset)
            late.setattr(shards, "refresh", lambda force=False: None)
            items = [Wanted(moving_job.name, "late-1"), Wanted(staying_job.name, "late-2")]
            answers = enqueue_many(team, items, Actor.system()).answers
        assert [answer.status for answer in answers] == [503, 201]
        assert f"shard {shard} is moving" in answers[0].detail
        (last,) = store.complete([(held[2].id, held[2].fencing_token, None)], team_ids=team)
        assert last.status == 200
    finally:
        mover.join(60)
    assert moved and moved[0].rows["runs_run"] == 5
    assert shards.alias_of_shard(shard) == target
    states = Run.objects.using(target).filter(shard=shard).values_list("state", flat=True)
    assert sorted(states) == sorted(["dead", fresh, fresh, "succeeded", "succeeded"])
    # New rows of the shard are kept out of the database it left (a process with an older map).
    # (The model routes by the current map; the row is written as an older map would.)
    stale = """
        INSERT INTO jobs_jobdefinition
        SELECT (jsonb_populate_record(d, jsonb_build_object(
            'id', d.id + 1, 'name', 'stale.map', 'shard', %s))).*
        FROM jobs_jobdefinition d WHERE d.id = %s
    """
    with pytest.raises(IntegrityError, match="has moved"), connections[source].cursor() as cursor:
        cursor.execute(stale, [shard, staying_job.pk])
    with connections[source].cursor() as cursor:  # another shard's row is still taken there
        cursor.execute(stale, [other, staying_job.pk])
        assert cursor.rowcount == 1


def test_a_move_refuses_a_target_that_holds_the_shard_and_a_shard_that_stays_leased(
    layout: Layout, team_a, placement_reset
):
    source, target = layout.aliases
    shard = shards.shards_on(source)[0]
    job = _job_of_shard(team_a, source, shard)
    layout.new_runs(job, 3, "r")
    (lease,) = claim(
        queues=["q"], max_runs=1, worker_id="slow", lease_seconds=600, team_ids=[team_a.pk]
    )

    with pytest.raises(CommandError, match=r"1 runs of shard \d+ are still leased"):
        call_command("moveshard", str(shard), "--to", layout.servers[1].url, "--wait", "1")
    # Undone: the shard takes new runs where it was, and its leased run still completes.
    assert shards.alias_of_shard(shard) == source and shard not in shards.moving()
    assert layout.new_runs(job, 1, "after")
    (outcome,) = store.complete([(lease.id, lease.fencing_token, None)], team_ids=[team_a.pk])
    assert outcome.status == 200
    assert not Run.objects.using(target).filter(shard=shard).exists()

    with shards.using(target):  # a row of the shard left on the target
        JobDefinition.objects.create(
            pk=shard + 1024 * 999, team=team_a, name=_names_of_shard(shard, 2)[1], queue="q"
        )
    with pytest.raises(CommandError, match="already holds rows of shard"):
        call_command("moveshard", str(shard), "--to", layout.servers[1].url)


def test_a_shard_moves_to_a_database_outside_the_map(
    layout: Layout, team_a, placement_reset, tmp_path
):
    """A new database (here on the second server), migrated by the move: `manage.py moveshard`
    as an operator runs it, in a process of its own (this one's test may not open a connection
    to a database it did not start with)."""
    source, _ = layout.aliases
    shard = shards.shards_on(source)[0]
    server = layout.servers[1].url
    new_url = urlunparse(urlparse(server)._replace(path="/moved_here"))
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS moved_here WITH (FORCE)")
        conn.execute("CREATE DATABASE moved_here")
    try:
        with shards.using(source):
            job = JobDefinition.objects.create(
                team=team_a, name=_names_of_shard(shard, 1)[0], queue="q", timeout_seconds=60
            )
        made = layout.new_runs(job, 5, "before")
        moved = manage("moveshard", str(shard), "--to", new_url, timeout=300)
        assert moved.returncode == 0, moved.stdout + moved.stderr

        # Every run of the shard is in the new database, none left behind, and the control
        # database routes the shard there.
        with psycopg.connect(new_url) as conn:
            there = conn.execute("SELECT id FROM runs_run WHERE shard = %s", [shard]).fetchall()
        assert sorted(pk for (pk,) in there) == sorted(made)
        assert not Run.objects.using(source).filter(shard=shard).exists()
        placement = ShardPlacement.objects.using(shards.CONTROL).get(shard=shard)
        assert placement.url == new_url

        # A command reads the moved shard where it went: `apply` finds the job there (it
        # planned to create it in the old database, which refuses the shard's rows).
        jobs_file = tmp_path / "jobs.yaml"
        jobs_file.write_text(f"team: {team_a.slug}\njobs: [{{name: {job.name}, queue: q}}]\n")
        planned = manage("apply", str(jobs_file), "--dry-run")
        assert planned.returncode == 0, planned.stdout + planned.stderr
        assert "0 create" in planned.stdout and f"+ {job.name}" not in planned.stdout
    finally:
        ShardPlacement.objects.using(shards.CONTROL).all().delete()
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS moved_here WITH (FORCE)")


def _another_url(url: str) -> str:
    """The same database under another URL (a query the connection ignores)."""
    parsed = urlparse(url)
    query = f"{parsed.query}&" if parsed.query else ""
    return urlunparse(parsed._replace(query=query + "connect_timeout=9"))


def test_a_move_refuses_the_shards_own_database_a_url_without_one_and_a_second_move(
    layout: Layout, placement_reset
):
    source, _ = layout.aliases
    shard = shards.shards_on(source)[0]
    same = manage("moveshard", str(shard), "--to", _another_url(child_database_url(source)))
    assert same.returncode == 1
    assert f"The target is the database shard {shard} lives in, under another URL" in same.stderr
    assert "Traceback" not in same.stderr
    # Another database of the map under another URL was taken for a new one: its jobs were
    # listed twice, and the command run again deleted the shard there as a leftover.
    for other in (layout.aliases[1], shards.CONTROL):
        taken = manage("moveshard", str(shard), "--to", _another_url(child_database_url(other)))
        assert taken.returncode == 1, taken.stdout + taken.stderr
        assert f"The target is the database of shards {shards.span(other)} under another URL" in (
            taken.stderr
        )
    assert shards.alias_of_shard(shard) == source
    with pytest.raises(CommandError, match="names no database"):
        call_command("moveshard", str(shard), "--to", "postgresql://")
    # One move of a shard at a time: a second, while the first holds the shard, is refused.
    with psycopg.connect(child_database_url(), autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s, %s)", [moves.MOVE_LOCKS, shard])
        with pytest.raises(CommandError, match=f"Another move of shard {shard} is under way"):
            call_command("moveshard", str(shard), "--to", layout.servers[1].url)
    # None of them changed anything.
    assert shards.alias_of_shard(shard) == source and shard not in shards.moving()
    assert not ShardPlacement.objects.using(shards.CONTROL).exists()


def test_a_move_that_died_half_way_is_released_by_moving_the_shard_where_it_is(
    layout: Layout, team_a, placement_reset
):
    source, target = layout.aliases
    shard = shards.shards_on(source)[0]
    job = _job_of_shard(team_a, source, shard)
    layout.new_runs(job, 2, "kept")
    # What a move killed after its copy leaves: the shard marked moving, its scheduler lease
    # held by the dead move for an hour, the guard and the freeze on the source, the copy on
    # the target.
    urls = (layout.servers[1].url, layout.servers[0].url)
    moves._begin(shard, urls, "moveshard:gone:1", source, target)
    moves._freeze(shard, source)
    with shards.using(target):
        JobDefinition.objects.create(
            pk=shard + 1024 * 999, team=team_a, name=job.name, queue="q", timeout_seconds=600
        )
    shards.refresh(force=True)
    assert shard in shards.moving() and moves.unfinished() == [shard]
    with pytest.raises(IntegrityError):
        layout.new_runs(job, 1, "refused")

    out = StringIO()
    call_command("moveshard", str(shard), "--to", layout.servers[0].url, stdout=out)
    assert f"released shard {shard}" in out.getvalue()
    assert (
        f"a move of shard {shard} to {target} died before its flip: deleted its copy (0 runs, 1 definitions)"
        in out.getvalue()
    )
    assert shard not in shards.moving() and shards.alias_of_shard(shard) == source
    assert moves.unfinished() == []
    assert not JobDefinition.objects.using(target).filter(shard=shard).exists()
    assert layout.new_runs(job, 1, "taken")  # no guard left either
    # Nor the freeze: its runs are leased where they are.
    taken = claim(queues=["q"], max_runs=10, worker_id="w", team_ids=[team_a.pk])
    assert len(taken) == 3
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute("SELECT owner FROM scheduler_shardlease WHERE shard = %s", [shard])
        assert cursor.fetchone()[0] == ""


def _started_move(shard: int, alias: str) -> tuple[subprocess.Popen, list[str]]:
    """`manage.py moveshard` to the database of `alias`, in a process of its own, its lines
    gathered as they come."""
    url = child_database_url(alias)
    process = manage_started("moveshard", str(shard), "--to", url, "--wait", "30")
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return process, lines


def _as_this_process_names(layout: Layout, shard: int) -> None:
    """The placement a move in a process of its own left, naming the databases by that
    process's URLs of them (its test databases), under the URLs this process's map has for
    the same databases."""
    placed = ShardPlacement.objects.using(shards.CONTROL).filter(shard=shard)
    for alias, server in zip(layout.aliases, layout.servers, strict=True):
        child = child_database_url(alias)
        placed.filter(url=child).update(url=server.url)
        placed.filter(moving_to=child).update(moving_to=server.url)
        placed.filter(moving_from=child).update(moving_from=server.url)
    shards.refresh(force=True)


def _frozen_on(alias: str, shard: int) -> bool:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_trigger WHERE tgname = %s", [f"shard_frozen_{shard}"])
        return cursor.fetchone() is not None


def test_a_move_killed_after_its_flip_leaves_no_run_to_run_twice(
    layout: Layout, team_a, placement_reset, monkeypatch
):
    """Killed while it kept the source's rows for the processes that had not read the map: they
    were claimable there again, and ran twice (once from each database) until the command was
    run again. They are frozen there now, leased once from the target, and the command run
    again deletes them."""
    source, target = layout.aliases
    shard = shards.shards_on(source)[0]
    job = _job_of_shard(team_a, source, shard)
    made = set(layout.new_runs(job, 20, "r"))

    process, lines = _started_move(shard, target)
    try:
        flipped = ShardPlacement.objects.using(shards.CONTROL).filter(shard=shard, url__gt="")
        wait_for(flipped.exists, 60, interval=0.02)
        # Its rows stay on the source for the processes that have not read the map yet.
        assert set(Run.objects.using(source).filter(shard=shard).values_list("pk", flat=True)) == (
            made
        )
    finally:
        process.kill()
        process.wait(10)
    assert "pointing shard" in "".join(lines)
    assert "now lives in" not in "".join(lines)
    _as_this_process_names(layout, shard)
    assert shards.alias_of_shard(shard) == target
    assert Run.objects.using(source).filter(shard=shard).count() == 20  # its delete undone
    assert moves.unfinished() == [shard]

    # A process whose map is behind (it would claim the shard on the source) leases none of
    # them there: frozen, as every other update of them is.
    with monkeypatch.context() as behind:
        behind.setattr(shards, "claimed_here", lambda alias: None if alias == source else [])
        assert claim(queues=["q"], max_runs=50, worker_id="behind", team_ids=[team_a.pk]) == []
    with connections[source].cursor() as cursor:
        cursor.execute("UPDATE runs_run SET state = 'cancelled' WHERE shard = %s", [shard])
        assert cursor.rowcount == 0
    assert _frozen_on(source, shard)
    # The target leases them once the flip has settled (every process has read the map), each
    # once in all.
    settles_at = ShardPlacement.objects.using(shards.CONTROL).get(shard=shard).settles_at
    if db_now() < settles_at:
        assert claim(queues=["q"], max_runs=50, worker_id="w", team_ids=[team_a.pk]) == []
    wait_for(lambda: db_now() >= settles_at, 10)
    shards.refresh(force=True)
    taken = claim(queues=["q"], max_runs=50, worker_id="w", team_ids=[team_a.pk])
    assert sorted(lease.id for lease in taken) == sorted(made)
    assert claim(queues=["q"], max_runs=50, worker_id="w", team_ids=[team_a.pk]) == []

    out = StringIO()
    call_command("moveshard", str(shard), "--to", layout.servers[1].url, stdout=out)
    assert (
        f"a move of shard {shard} died after its flip: deleted the 20 runs and 1 definitions"
        f" its source ({source}) kept"
    ) in out.getvalue()
    assert not Run.objects.using(source).filter(shard=shard).exists()
    assert not _frozen_on(source, shard) and moves.unfinished() == []
    assert Run.objects.using(target).filter(pk__in=made, state="leased").count() == 20


def test_a_move_killed_before_its_flip_leaves_a_copy_no_claim_takes(
    layout: Layout, team_a, placement_reset, monkeypatch
):
    """Killed between its copy and its flip, into a database that holds other shards: the copy
    was leased there at once (claims take every run of their database), its runs ran, then ran
    again from the source. The copy is taken by no claim, the source's rows by none either
    (frozen: the copy was the shard's by then), `scheduler_shard_move_unfinished` says so, and
    the command run again deletes the copy and moves the shard."""
    source, target = layout.aliases
    shard = shards.shards_on(source)[0]
    job = _job_of_shard(team_a, source, shard)
    made = set(layout.new_runs(job, 10, "r"))

    process, lines = _started_move(shard, target)
    holder = psycopg.connect(child_database_url(), autocommit=False)
    try:
        wait_for(lambda: "copying shard" in "".join(lines), 60, interval=0.02)
        # The flip waits for this lock on the shard's placement: the move is held before it.
        holder.execute("SELECT 1 FROM runs_shardplacement WHERE shard = %s FOR UPDATE", [shard])
        wait_for(lambda: "pointing shard" in "".join(lines), 60, interval=0.02)
        time.sleep(0.3)  # at the flip's lock
    finally:
        process.kill()
        process.wait(10)
        holder.rollback()
        holder.close()
    _as_this_process_names(layout, shard)
    assert shards.alias_of_shard(shard) == source
    assert Run.objects.using(target).filter(shard=shard).count() == 10  # the copy committed
    assert _frozen_on(source, shard)
    assert moves.unfinished() == [shard]
    assert claim(queues=["q"], max_runs=50, worker_id="w", team_ids=[team_a.pk]) == []
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute("SELECT owner FROM scheduler_shardlease WHERE shard = %s", [shard])
        assert cursor.fetchone()[0].startswith("moveshard:")  # held for the hour

    out = StringIO()
    call_command("moveshard", str(shard), "--to", layout.servers[1].url, stdout=out)
    assert (
        f"a move of shard {shard} to {target} died before its flip: deleted its copy (10 runs,"
        " 1 definitions)"
    ) in out.getvalue()
    assert shards.alias_of_shard(shard) == target and moves.unfinished() == []
    assert not Run.objects.using(source).filter(shard=shard).exists()
    assert not _frozen_on(source, shard) and not _frozen_on(target, shard)
    settles_at = ShardPlacement.objects.using(shards.CONTROL).get(shard=shard).settles_at
    wait_for(lambda: db_now() >= settles_at, 10)
    shards.refresh(force=True)
    taken = claim(queues=["q"], max_runs=50, worker_id="w", team_ids=[team_a.pk])
    assert sorted(lease.id for lease in taken) == sorted(made)


def test_a_move_whose_source_is_down_fails_clearly_and_is_released_afterwards(
    layout: Layout, team_a, placement_reset
):
    source, _ = layout.aliases
    shard = shards.shards_on(source)[0]
    with layout.down(0), pytest.raises(CommandError, match="cannot be reached"):
        call_command("moveshard", str(shard), "--to", layout.servers[1].url)
    # Back: the shard is where it was; whatever the failed move could not undo while its
    # source was down, moving it where it is releases.
    call_command("moveshard", str(shard), "--to", layout.servers[0].url, stdout=StringIO())
    assert shards.alias_of_shard(shard) == source and shard not in shards.moving()
    job = _job_of_shard(team_a, source, shard)
    assert layout.new_runs(job, 1, "after")


def test_a_blob_of_a_shard_just_moved_is_kept_by_a_process_whose_map_is_behind(
    layout: Layout, team_a, placement_reset, settings, payload_folder, monkeypatch
):
    """The shard's runs were copied to a database this process's map (a second old) did not
    name, then deleted where it looked: the blob they share was deleted as unreferenced."""
    from apps.runs import payloads
    from scheduler_site.shardmap import ShardMap

    source, _ = layout.aliases
    shard = shards.shards_on(source)[0]
    job = _job_of_shard(team_a, source, shard)
    payload = {"rows": ["x" * 100 for _ in range(100)]}  # kept in storage
    with shards.using(source):
        now = db_now()
        store.insert_runs([store.NewRun(job.pk, "api", now, now, "shared", payload)])
    key = Run.objects.using(source).get(definition_id=job.pk).payload_key
    call_command("moveshard", str(shard), "--to", layout.servers[1].url)
    # This process has not read the move: every shard where the settings put the source's.
    urls = {alias: url for alias, url in shards.current_map().urls.items() if alias == source}
    behind = ShardMap(aliases=(source,) * settings.SCHEDULER_SHARD_COUNT, urls=urls)
    monkeypatch.setattr(shards, "_placement", shards._Placement(behind))
    monkeypatch.setattr(shards, "_checked_at", time.monotonic())
    try:
        assert payloads.delete_unreferenced([key]) == 0
        assert (payload_folder / key).exists()
    finally:
        monkeypatch.undo()


def test_a_batch_refused_by_a_first_moves_guard_in_the_control_database_wrote_nothing(
    layout: Layout, team_a, placement_reset, monkeypatch
):
    """Before any move is known, a guard met in the control database spoils the request's
    transaction and refuses the batch whole (503): its items bound for another database had
    committed before it, runs made under a 503 (a move's start, under load)."""
    source, _ = layout.aliases
    far = layout.job_on(source, team_a, "far")
    near = layout.job_on(shards.CONTROL, team_a, "near")
    name = f"{MOVED_GUARD_PREFIX}{near.shard}"
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(moves.ADD_GUARD.format(name=name, table="runs_run", shard=near.shard))
    monkeypatch.setattr(shards, "refresh", lambda force=False: None)
    monkeypatch.setattr(shards, "ever_moved", lambda: False)
    items = [Wanted(far.name, "f-1"), Wanted(near.name, "n-1")]
    with pytest.raises(shards.Moving, match=f"shard {near.shard} is moving"):
        enqueue_many([team_a.pk], items, Actor.system())
    assert not Run.objects.using(source).filter(definition_id=far.pk).exists()
    assert not Run.objects.using(shards.CONTROL).filter(definition_id=near.pk).exists()


def test_a_move_behind_a_session_left_open_gives_up_rather_than_stall_the_claims(
    layout: Layout, team_a, placement_reset, monkeypatch
):
    """Its guard waited for a session left open in a transaction on the runs table, and every
    claim on the database queued behind it, for as long as that session stayed open. Each
    change of the triggers waits half a second at most, a few times; then the move is undone."""
    source, _ = layout.aliases
    shard = shards.shards_on(source)[0]
    job = _job_of_shard(team_a, source, shard)
    monkeypatch.setattr(moves, "DDL_TRIES", 2)
    with psycopg.connect(child_database_url(source)) as idle:
        idle.execute("UPDATE runs_run SET worker_id = worker_id WHERE false")  # the table held
        with pytest.raises(CommandError, match="stayed locked by other sessions"):
            call_command("moveshard", str(shard), "--to", layout.servers[1].url)
        idle.rollback()
    assert shards.alias_of_shard(shard) == source and shard not in shards.moving()
    assert moves.unfinished() == []
    assert layout.new_runs(job, 1, "after")  # no guard left behind


def test_a_copy_the_undo_could_not_delete_is_leased_by_no_claim_until_the_command_deletes_it(
    layout: Layout, team_a, placement_reset, monkeypatch
):
    """A move that failed after its copy, its target down for the undo: the copy stayed there,
    with nothing left to say so, and claims on the target leased its runs (they ran there and
    where the shard still lives)."""
    from django.db import OperationalError

    source, target = layout.aliases
    shard = shards.shards_on(source)[0]
    job = _job_of_shard(team_a, source, shard)
    made = layout.new_runs(job, 5, "r")
    delete = moves._delete_shard

    def flip(*args) -> None:
        raise OperationalError("the control database went away")

    def target_down(shard: int, alias: str) -> tuple[int, int]:
        if alias == target:
            raise OperationalError("the target went away")
        return delete(shard, alias)

    with monkeypatch.context() as failing:
        failing.setattr(moves, "_flip", flip)
        failing.setattr(moves, "_delete_shard", target_down)
        with pytest.raises(CommandError, match="went away"):
            call_command("moveshard", str(shard), "--to", layout.servers[1].url)
    shards.refresh(force=True)
    assert shards.alias_of_shard(shard) == source and shard not in shards.moving()
    assert Run.objects.using(target).filter(shard=shard).count() == 5  # the copy, left
    assert moves.unfinished() == [shard]
    taken = claim(queues=["q"], max_runs=50, worker_id="w", team_ids=[team_a.pk])
    assert sorted(lease.id for lease in taken) == sorted(made)
    assert not Run.objects.using(target).filter(shard=shard, state="leased").exists()

    out = StringIO()
    call_command("moveshard", str(shard), "--to", layout.servers[0].url, stdout=out)
    assert f"a move of shard {shard} to {target} died before its flip" in out.getvalue()
    assert not Run.objects.using(target).filter(shard=shard).exists()
    assert moves.unfinished() == []


def test_a_long_poll_opened_before_a_move_leases_no_copy_of_the_shard(
    layout: Layout, team_a, placement_reset, ready_listener
):
    """A long poll read the map at its request's start only: opened before a move, it claimed
    by a map that knew of none (every shard of every database) and leased a run from both the
    source and the move's copy, in one answer. Each try reads the map."""
    source, target = layout.aliases
    shard = shards.shards_on(source)[0]
    job = _job_of_shard(team_a, source, shard)
    with shards.using(source):
        due = db_now() + timedelta(seconds=3)
        (run,) = store.insert_runs([store.NewRun(job.pk, "api", due, due, "later")])
    shards.refresh(force=True)  # no move known
    got: list = []

    def poll() -> None:
        try:
            got.extend(
                claim(
                    queues=["q"], max_runs=5, worker_id="w", team_ids=[team_a.pk], wait_seconds=15
                )
            )
        finally:
            connections.close_all()

    polling = threading.Thread(target=poll)
    polling.start()
    time.sleep(0.5)  # waiting for the run
    # What a move that died after its copy leaves, made without reading the map here.
    urls = (layout.servers[1].url, layout.servers[0].url)
    moves._begin(shard, urls, "moveshard:gone:1", source, target)
    with transaction.atomic(using=source), transaction.atomic(using=target):
        moves._copy(shard, source, target, moves.Moved(shard, ""))
    polling.join(20)
    assert [lease.id for lease in got] == [run]
    assert Run.objects.using(target).get(pk=run).state == "scheduled"  # the copy, not leased
