"""The failures' error-text search reads at most SEARCH_SCAN runs per (team, state) a page, and
its pages, followed to the end, find every match once, newest first."""

from __future__ import annotations

import random

import pytest

from apps.jobs import runlist
from tests.conftest import db_now, make_definition
from tests.dashboard.conftest import client_for, failed_runs, make_user

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def search(team_ids: list[int], text: str, *, limit: int) -> list[runlist.RunPage]:
    """Every page of a search of the failures, following each page's cursor."""
    flt = runlist.RunFilter(team_ids=team_ids, branches=runlist.FAILED_STORED, error=text)
    pages, before = [], None
    while True:
        page = runlist.run_page(flt, db_now(), before=before, limit=limit)
        pages.append(page)
        if page.next_cursor is None:
            return pages
        before = page.next_cursor


def ids(pages: list[runlist.RunPage]) -> list[int]:
    return [run.pk for page in pages for run in page.runs]


def test_a_search_reads_its_budget_then_goes_on_below_it(team_a, monkeypatch):
    monkeypatch.setattr(runlist, "SEARCH_SCAN", 5)
    job = make_definition(team_a, "search.job", queue="search")
    runs = [
        failed_runs(job, 1, message="needle here" if n in (1, 10) else f"hay {n}", prefix=f"s{n}")[
            0
        ]
        for n in range(12)
    ]
    first, second, third = search([team_a.pk], "NEEDLE", limit=50)
    # The newest five (11..7) hold one match; the page says how far it looked.
    assert [run.pk for run in first.runs] == [runs[10].pk]
    assert first.searched_to == first.next_cursor == runs[7].pk
    assert second.runs == [] and second.searched_to == runs[2].pk  # 6..2: none
    assert [run.pk for run in third.runs] == [runs[1].pk]  # 1..0, fewer than five: all read
    assert third.searched_to is None and third.next_cursor is None


@pytest.mark.shards  # the databases' floors merged
def test_followed_to_the_end_the_pages_find_every_match_once(team_a, team_b, monkeypatch):
    monkeypatch.setattr(runlist, "SEARCH_SCAN", 3)
    chance = random.Random(20261204)
    for team in (team_a, team_b):
        job = make_definition(team, f"{team.slug}.search", queue=f"{team.slug}-q")
        for n in range(14):
            message = "Timeout talking to db" if chance.random() < 0.4 else f"refused {n}"
            failed_runs(job, 1, message=message, retryable=n % 3 == 0, prefix=f"{team.slug}{n}")
    team_ids = [team_a.pk, team_b.pk]
    everything = runlist.run_page(
        runlist.RunFilter(team_ids=team_ids, branches=runlist.FAILED_STORED),
        db_now(),
        before=None,
        limit=1000,
    )
    expected = [run.pk for run in everything.runs if "timeout" in run.last_error["message"].lower()]
    assert len(everything.runs) == 28 and 3 < len(expected) < 25
    for limit in (1, 2, 50):
        pages = search(team_ids, "timeout", limit=limit)
        assert ids(pages) == expected, limit
        assert all(len(page.runs) <= limit for page in pages)
    assert any(page.searched_to for page in search(team_ids, "timeout", limit=50))


def test_the_failures_page_says_how_far_it_searched(team_a, monkeypatch):
    monkeypatch.setattr(runlist, "SEARCH_SCAN", 4)
    job = make_definition(team_a, "search.page", queue="page")
    failed_runs(job, 1, message="the needle", prefix="old")
    failed_runs(job, 6, message="hay", prefix="new")
    client = client_for(make_user("searcher", team_a, "viewer"))
    body = client.get("/failures?error=needle").content.decode()
    assert 'id="searched-to"' in body and "Search older →" in body
    assert "the needle" not in body and "No match among the runs searched so far" in body
    assert "Nothing is failing" not in body
    cursor = body.split("cursor=")[1].split('"')[0].split("&")[0]
    older = client.get(f"/failures?error=needle&cursor={cursor}").content.decode()
    assert "the needle" in older and 'id="searched-to"' not in older


def test_a_cursor_that_is_not_one_is_a_form_error(team_a):
    client = client_for(make_user("cursor-reader", team_a, "viewer"))
    for cursor in ("abc", "run_!!!", "-1", "rün_ß"):
        body = client.get(f"/failures?error=x&cursor={cursor}").content.decode()
        assert "cursor: Not a cursor from a previous page." in body, cursor
