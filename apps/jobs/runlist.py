"""Run lists: the runs of some teams, newest first, filtered and paged by keyset, as the API's
runs and dead-letter lists and the dashboard's runs, failures and DLQ pages show them.

No list counts the runs table: each page is a handful of index scans that stop after the page
size, so page 2 000 costs what page 1 does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Q

from apps.jobs.models import JobDefinition, database_of
from apps.runs import shards
from apps.runs.models import Run, State, reported_state

PAGE_SIZE = 50
# Runs per (team, stored state) that one page of an error-text search reads, newest first. The
# text is in the row, not in an index: 1.3 M failed runs took 1 059 ms to search in full
# (bench/bigtables.py with the dashboard benchmark's shares), ~1.6 µs a run.
SEARCH_SCAN = 10_000

# A branch of a list: a stored state, and "due" (available_at <= now), "future"
# (available_at > now) or None (either).
Branch = tuple[str, str | None]

# A reported state is one or more stored states, the waiting ones split by the clock.
REPORTED_TO_STORED: dict[str, list[Branch]] = {
    State.READY: [(State.SCHEDULED, "due"), (State.READY, None), (State.RETRYING, "due")],
    State.SCHEDULED: [(State.SCHEDULED, "future")],
    State.RETRYING: [(State.RETRYING, "future")],
    State.LEASED: [(State.LEASED, None)],
    State.SUCCEEDED: [(State.SUCCEEDED, None)],
    State.DEAD: [(State.DEAD, None)],
    State.CANCELLED: [(State.CANCELLED, None)],
}
ALL_STORED: list[Branch] = [(state.value, None) for state in State]
# The failures page: runs that failed and have not (yet) succeeded, whatever their backoff says.
FAILED_STORED: list[Branch] = [(State.RETRYING.value, None), (State.DEAD.value, None)]


@dataclass
class RunFilter:
    team_ids: list[int]
    branches: list[Branch] = field(default_factory=lambda: list(ALL_STORED))
    queue: str = ""
    job: str = ""  # a definition's name
    created_from: datetime | None = None
    due_from: datetime | None = None
    due_to: datetime | None = None
    # A substring of the last error's message or type. Read from each run's row, so a search
    # reads at most SEARCH_SCAN runs per (team, state) on a page: see `run_page`.
    error: str = ""
    # The last error's group (apps/runs/fingerprints.py): a team's runs of one group, newest
    # first, are read from run_failed_by_fingerprint (team_id, error_fingerprint, state, id).
    fingerprint: int | None = None


@dataclass
class RunPage:
    runs: list[Run]
    next_cursor: int | None
    # Shards whose database could not be read for this page ("5-10"): their runs are missing.
    unavailable: list[str] = field(default_factory=list)
    # An error-text search that stopped at its scan budget: every run from this id up was
    # searched, and the next page (cursor `next_cursor`, this id) goes on below it.
    searched_to: int | None = None


def _branch(
    flt: RunFilter, team_id: int, state: str, clock: str | None, definition_id: int | None, now
):
    queryset = Run.objects.filter(team_id=team_id, state=state)
    if clock == "due":
        queryset = queryset.filter(available_at__lte=now)
    elif clock == "future":
        queryset = queryset.filter(available_at__gt=now)
    if flt.queue:
        queryset = queryset.filter(queue=flt.queue)
    if definition_id is not None:
        queryset = queryset.filter(definition_id=definition_id)
    if flt.created_from is not None:
        queryset = queryset.filter(created_at__gte=flt.created_from)
    if flt.due_from is not None:
        queryset = queryset.filter(due_at__gte=flt.due_from)
    if flt.due_to is not None:
        queryset = queryset.filter(due_at__lt=flt.due_to)
    if flt.error:
        queryset = queryset.filter(
            Q(last_error__message__icontains=flt.error) | Q(last_error__type__icontains=flt.error)
        )
    if flt.fingerprint is not None:
        queryset = queryset.filter(error_fingerprint=flt.fingerprint)
    return queryset


def run_page(
    flt: RunFilter, now: datetime, *, before: int | None, limit: int = PAGE_SIZE
) -> RunPage:
    """One page of runs, newest first (by id), older than the cursor `before` (a run pk), from
    every shard database (the job's alone when the filter names one), merged by id: consistent
    within each database. A database that cannot be read leaves its runs out and its shards in
    `unavailable`.

    1. A job filter is resolved to its definition (the unique name index) first, so that the
       planner can take run_definition_recent (definition_id, -id).
    2. On each database, one branch per (team, stored state), each an index scan on
       run_team_state (team_id, state, -id) that stops after `limit + 1` rows, merged by id: the
       cost follows the page size, not the table size.
    3. The page's runs, with their definitions and teams, by primary key.
    """
    if not flt.team_ids or not flt.branches:
        return RunPage([], None)
    if flt.job:
        # The job's runs are all in its shard's database.
        alias = database_of(flt.job)
        with shards.reaching(alias):
            pages, unavailable = [_page_ids(flt, now, before, limit)], []
    else:
        pages, unavailable = shards.gather(lambda: _page_ids(flt, now, before, limit))
    # Each database searched down to its floor: together, down to the highest of them.
    floor = max((page.floor for page in pages if page.floor is not None), default=None)
    found = [pk for page in pages for pk in page.ids if floor is None or pk >= floor]
    found.sort(reverse=True)
    more = len(found) > limit
    found = found[:limit]
    runs: list[Run] = []
    # Read again by key, a run may have moved since its id was found (a DLQ run requeued): one
    # no longer in a state the filter asks for is left out, not shown under it.
    stored = {state for state, _ in flt.branches}
    for alias, ids in shards.runs_by_database(found).items():
        with shards.reaching(alias):
            rows = Run.objects.filter(pk__in=ids, state__in=stored).select_related("definition")
            runs += shards.with_teams(rows)
    runs.sort(key=lambda run: run.pk, reverse=True)
    for run in runs:
        run.shown_state = reported_state(run.state, run.available_at, now)
    if more and found:
        return RunPage(runs, found[-1], unavailable)
    if floor is not None:
        return RunPage(runs, floor, unavailable, searched_to=floor)
    return RunPage(runs, None, unavailable)


@dataclass
class _Ids:
    ids: list[int]  # up to `limit + 1`, newest first
    # With an error-text search: the lowest id searched, when the scan budget stopped it.
    floor: int | None = None


def _page_ids(flt: RunFilter, now: datetime, before: int | None, limit: int) -> _Ids:
    """Up to `limit + 1` ids of the current shard database's runs, newest first."""
    definition_id = None
    team_ids = flt.team_ids
    if flt.job:
        # Being deleted too: its runs are listed until they are gone, by its name as well.
        found = (
            JobDefinition.everything.filter(name=flt.job, team_id__in=flt.team_ids)
            .values_list("pk", "team_id")
            .first()
        )
        if found is None:
            return _Ids([])
        # Its team's branches only: another team's would each read that team's runs in the
        # state whole, finding none of the job's (1.9 s at 10 M runs over five teams).
        definition_id, team_ids = found[0], [found[1]]
    floor = _search_floor(flt, team_ids, before) if flt.error else None
    branches = []
    for team_id in team_ids:
        for state, clock in flt.branches:
            queryset = _branch(flt, team_id, state, clock, definition_id, now)
            if before is not None:
                queryset = queryset.filter(pk__lt=before)
            if floor is not None:
                queryset = queryset.filter(pk__gte=floor)
            branches.append(queryset.order_by("-pk").values_list("pk", flat=True)[: limit + 1])
    return _Ids(sorted(_union(branches), reverse=True)[: limit + 1], floor)


def _union(querysets: list) -> list:
    return list(
        querysets[0] if len(querysets) == 1 else querysets[0].union(*querysets[1:], all=True)
    )


def _search_floor(flt: RunFilter, team_ids: list[int], before: int | None) -> int | None:
    """The id down to which a text search reads: the highest of each (team, stored state)'s
    SEARCH_SCAN-th run below the cursor, by index-only scans of run_team_state (team_id, state,
    -id) that stop there; None when no branch has that many left (the search reads them all)."""
    nth = []
    for team_id in team_ids:
        for state in dict.fromkeys(state for state, _ in flt.branches):
            queryset = Run.objects.filter(team_id=team_id, state=state)
            if before is not None:
                queryset = queryset.filter(pk__lt=before)
            nth.append(
                queryset.order_by("-pk").values_list("pk", flat=True)[SEARCH_SCAN - 1 : SEARCH_SCAN]
            )
    return max(_union(nth), default=None)
