"""Hostile and careless input: nothing lost, nothing half-written, nothing widened.

Each test holds one rule; together they are the classes of input that once broke a team's
leases, emptied a dead-letter queue or flooded an audit trail.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from django.core.cache import cache

from apps.audit.models import AuditEvent
from apps.jobs.models import JobDefinition, Queue
from apps.runs.ids import parse_run_id, public_run_id
from apps.runs.models import Attempt, Run
from tests.conftest import add_ready_runs, db_now, make_definition

DEPTH = 300  # past the encoder's 254 levels: such a value could be stored but never rendered


def deep(depth: int = DEPTH, leaf: object = 1) -> object:
    value = leaf
    for index in range(depth):
        value = {"k": value} if index % 2 else [value]
    return value


@pytest.fixture(autouse=True)
def _no_throttling(settings):
    settings.SCHEDULER_API_RATES = {"worker": "", "manage": ""}
    cache.clear()


def assert_problem(answer, status: int, field: str | None = None) -> dict:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    body = answer.json()
    if field is not None:
        assert field in body.get("errors", {}), body
    return body


def leased(api, queue: str, count: int = 10) -> list[dict]:
    return api.lease([queue], count)


# --- 1. JSON depth ---------------------------------------------------------------------------


def test_a_run_with_a_payload_nested_past_the_limit_is_refused_and_not_written(api_a, team_a):
    make_definition(team_a, "deep.job", queue="deep")
    answer = api_a.post("/api/v1/jobs/deep.job/runs", {"payload": deep()})
    assert_problem(answer, 400, "payload")
    assert not Run.objects.exists()
    # Just past the limit of 64 is refused too; at the limit is fine.
    assert_problem(api_a.post("/api/v1/jobs/deep.job/runs", {"payload": deep(64)}), 400)
    assert api_a.post("/api/v1/jobs/deep.job/runs", {"payload": deep(63)}).status_code == 201


def test_a_definition_with_a_payload_nested_past_the_limit_is_refused_and_not_saved(api_a):
    answer = api_a.put("/api/v1/jobs/deep.definition", {"queue": "deep", "payload": deep()})
    assert_problem(answer, 400, "payload")
    assert not JobDefinition.objects.filter(name="deep.definition").exists()
    assert api_a.get("/api/v1/jobs").status_code == 200


def test_a_result_nested_past_the_limit_is_refused_on_both_dispatch_paths(api_a, team_a):
    definition = make_definition(team_a, "deep.result", queue="deep")
    add_ready_runs(definition, 2)
    first, second = leased(api_a, "deep")
    body = {"fencingToken": first["fencingToken"], "result": deep()}
    # A plain JSON POST takes the worker fast path; an Accept header with a parameter goes
    # through DRF's dispatch. Both refuse the same way.
    fast = api_a.post(f"/api/v1/runs/{first['runId']}/complete", body)
    slow = api_a.post(
        f"/api/v1/runs/{first['runId']}/complete",
        body,
        headers={"Accept": "application/json; q=0.9"},
    )
    assert assert_problem(fast, 400, "result") == assert_problem(slow, 400, "result")
    batch = {
        "results": [
            {"runId": second["runId"], "fencingToken": second["fencingToken"],
             "outcome": "succeeded", "result": {"ok": True}},
            {"runId": first["runId"], "fencingToken": first["fencingToken"],
             "outcome": "succeeded", "result": deep()},
        ]
    }  # fmt: skip
    assert_problem(api_a.post("/api/v1/results", batch), 400, "results[1].result")
    # Nothing of the refused batch was applied, and every list still renders.
    assert set(Run.objects.values_list("state", flat=True)) == {"leased"}
    for path in ("/api/v1/runs", "/api/v1/dlq", "/api/v1/jobs", f"/api/v1/runs/{first['runId']}"):
        assert api_a.get(path).status_code == 200, path


@pytest.mark.parametrize("number", [10**25, -(10**25), 10**300, 10**20])
def test_an_integer_past_64_bits_that_is_a_floats_value_written_out_is_that_float(
    api_a, team_a, number
):
    """PostgreSQL writes a stored 1e25 back as 10000000000000000000000000: nothing is lost when
    a float's parser reads that, so it is taken (as the float), and a payload read back can be
    sent again. In a body the standard library reads (one holding 1e400), too."""
    make_definition(team_a, "wide.job", queue="wide")
    answer = api_a.post("/api/v1/jobs/wide.job/runs", {"payload": {"n": number}})
    assert answer.status_code == 201, answer.text
    assert Run.objects.get().payload == {"n": number}  # stored whole, read back whole
    batch = (
        '{"runs": [{"job": "wide.job", "payload": {"n": 1e400}}, '
        f'{{"job": "wide.job", "payload": {{"n": {number}}}}}]}}'
    )
    items = api_a.post(
        "/api/v1/runs", content=batch, headers={"Content-Type": "application/json"}
    ).json()["runs"]
    assert [item["status"] for item in items] == [400, 201]
    assert Run.objects.get(pk=parse_run_id(items[1]["run"]["runId"])).payload == {"n": number}


@pytest.mark.parametrize("number", [2**64, -(2**63) - 1, 2**70])
def test_an_integer_past_64_bits_is_refused_not_rounded(api_a, team_a, number):
    """JSON's parser here reads such an integer as a float: stored, 2**70 would have come back
    as 1180591620717411300000. It is refused, on every path that parses a body."""
    definition = make_definition(team_a, "wide.job", queue="wide")
    answer = api_a.post("/api/v1/jobs/wide.job/runs", {"payload": {"n": number}})
    assert "outside 64 bits" in str(assert_problem(answer, 400)["errors"]["payload"])
    assert not Run.objects.exists()
    # A setting's own field is named down to the field, not its object.
    settings = {"queue": "wide", "rateLimit": {"count": 5, "periodSeconds": number}}
    named = assert_problem(api_a.put("/api/v1/jobs/wide.job", settings), 400)
    assert list(named["errors"]) == ["rateLimit.periodSeconds"]
    add_ready_runs(definition, 1)
    (lease,) = leased(api_a, "wide")
    body = {"fencingToken": lease["fencingToken"], "result": {"n": number}}
    assert_problem(api_a.post(f"/api/v1/runs/{lease['runId']}/complete", body), 400)
    assert Run.objects.get().state == "leased"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({"n": 2**70}, "outside 64 bits"),
        ({"n": 10**309}, "outside 64 bits"),  # past a double's range: orjson cannot read it
        ({"text": "a\x00b"}, "NUL character"),
        ({"a\x00": 1}, "NUL character"),
        (deep(62), "Nested deeper than 64 levels"),
    ],
    ids=["integer", "huge-integer", "nul", "nul-key", "depth"],
)
def test_a_batch_item_holding_a_value_no_body_may_is_refused_alone(api_a, team_a, value, reason):
    """Each item of a bulk enqueue is answered on its own, as the README says, also when it
    holds what the body's parser refuses: before, one such item refused the whole batch."""
    make_definition(team_a, "mixed.job", queue="mixed")
    bulk = {
        "runs": [
            {"job": "mixed.job", "idempotencyKey": "before"},
            {"job": "mixed.job", "idempotencyKey": "bad", "payload": value},
            {"job": "mixed.job", "idempotencyKey": "after", "payload": deep(61)},
        ]
    }
    answer = api_a.post("/api/v1/runs", bulk)
    assert answer.status_code == 200, answer.text
    before, bad, after = answer.json()["runs"]
    assert (before["status"], bad["status"], after["status"]) == (201, 400, 201)
    assert list(bad["errors"]) == ["payload"]
    assert reason in bad["errors"]["payload"][0]
    assert sorted(Run.objects.values_list("idempotency_key", flat=True)) == ["after", "before"]
    # Outside the items, the body is refused whole, naming where (down to the key, when it is
    # a name a schema could have: "note.n").
    wrong = {"runs": [{"job": "mixed.job", "idempotencyKey": "k"}], "note": value}
    problem = assert_problem(api_a.post("/api/v1/runs", wrong), 400)
    (where,) = problem["errors"]
    assert where.split(".")[0].split("[")[0] == "note" and "\x00" not in where
    assert Run.objects.count() == 2


def test_a_float_past_a_doubles_range_is_refused_in_its_item_alone(api_a, team_a):
    make_definition(team_a, "mixed.job", queue="mixed")
    body = b'{"runs": [{"job": "mixed.job"}, {"job": "mixed.job", "payload": {"x": -1e400}}]}'
    answer = api_a.http.post(
        "/api/v1/runs", content=body, headers={"Content-Type": "application/json"}
    )
    assert answer.status_code == 200, answer.text
    first, second = answer.json()["runs"]
    assert (first["status"], second["status"]) == (201, 400)
    assert "past a 64-bit float's range" in second["errors"]["payload"][0]
    assert Run.objects.count() == 1


@pytest.mark.parametrize("digits", [4301, 20000])
def test_an_integer_past_pythons_conversion_limit_is_refused_in_its_item_alone(
    api_a, team_a, digits
):
    """Past 4 300 digits Python refuses to convert an integer: the whole batch was refused
    with its words ("use sys.set_int_max_str_digits() to increase the limit")."""
    make_definition(team_a, "mixed.job", queue="mixed")
    number = "9" * digits
    body = b'{"runs": [{"job": "mixed.job"}, {"job": "mixed.job", "payload": {"x": %s}}]}'
    answer = api_a.http.post(
        "/api/v1/runs", content=body % number.encode(), headers={"Content-Type": "application/json"}
    )
    assert answer.status_code == 200, answer.text
    first, second = answer.json()["runs"]
    assert (first["status"], second["status"]) == (201, 400)
    assert second["errors"]["payload"] == [
        f"The integer {'9' * 30}… is outside 64 bits and would lose digits: send it as a string."
    ]
    assert Run.objects.count() == 1
    # Outside an item, the body is refused naming where, in the same words.
    whole = api_a.http.post(
        "/api/v1/jobs/mixed.job/runs",
        content=b'{"payload": {"x": -%s}}' % number.encode(),
        headers={"Content-Type": "application/json"},
    )
    assert "outside 64 bits" in assert_problem(whole, 400)["errors"]["payload"][0]


def test_a_payload_under_the_cap_in_a_body_over_it_is_counted_as_utf8(api_a, team_a, settings):
    """A body past the payload cap has each payload measured: counted as ASCII JSON (an "é"
    six bytes, \\u00e9), three payloads of a third of the cap each were refused as 413."""
    settings.SCHEDULER_PAYLOAD_MAX_BYTES = 30_000
    make_definition(team_a, "accents.job", queue="accents")
    accents = {"s": "é" * 6_000}  # 12 008 bytes as UTF-8 JSON, 36 008 as ASCII
    bulk = {"runs": [{"job": "accents.job", "payload": accents} for _ in range(3)]}
    answer = api_a.post("/api/v1/runs", bulk)
    assert answer.status_code == 200, answer.text
    assert [item["status"] for item in answer.json()["runs"]] == [201, 201, 201]
    over = {"runs": [{"job": "accents.job", "payload": {"s": "é" * 15_000}}] * 2}
    (refused, _) = api_a.post("/api/v1/runs", over).json()["runs"]
    assert refused["status"] == 413
    assert refused["detail"] == "The payload is 30008 bytes; the limit is 30000."


@pytest.mark.parametrize("offset", ["+16:00", "-23:59", "+15:59"])
def test_a_run_time_offset_postgresql_does_not_take_is_read_in_utc(api_a, team_a, offset):
    """Python reads offsets up to ±23:59, PostgreSQL only to ±15:59: such a runAt was a 500."""
    make_definition(team_a, "far.zone", queue="far")
    at = f"2030-01-01T00:00:00{offset}"
    answer = api_a.post("/api/v1/jobs/far.zone/runs", {"runAt": at})
    assert answer.status_code == 201, answer.text
    expected = datetime.fromisoformat(at).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert answer.json()["dueAt"] == expected


def test_a_thousand_levels_around_a_long_integer_are_a_400_not_a_500(api_a, team_a):
    """Read again for its integers, such a body passed orjson's depth limit (1 024) and not the
    standard library's (1 000): a RecursionError, answered 500."""
    make_definition(team_a, "deep.job", queue="deep")
    deep_number = b"[" * 1000 + b"12345678901234567890123" + b"]" * 1000
    for body, where in (
        (b'{"payload": ' + deep_number + b"}", "/api/v1/jobs/deep.job/runs"),
        (b'{"runs": [{"job": "deep.job", "payload": ' + deep_number + b"}]}", "/api/v1/runs"),
    ):
        answer = api_a.http.post(where, content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code in (200, 400), answer.text
        refused = answer.json() if answer.status_code == 400 else answer.json()["runs"][0]
        assert "Nested deeper than" in str(refused["errors"]), refused
    assert not Run.objects.exists()


def test_an_integer_past_64_bits_stored_before_the_refusal_still_renders(api_a, team_a):
    definition = make_definition(team_a, "wide.job", queue="wide")
    (run_id,) = add_ready_runs(definition, 1)
    Run.objects.filter(pk=run_id).update(payload={"n": 2**70})
    answer = api_a.get(f"/api/v1/runs/{public_run_id(run_id)}")
    assert answer.status_code == 200, answer.text
    assert answer.json()["payload"] == {"n": 2**70}


def test_integers_at_64_bits_and_long_digit_strings_are_taken_exactly(api_a, team_a):
    make_definition(team_a, "wide.job", queue="wide")
    payload = {"max": 2**64 - 1, "min": -(2**63), "key": "1" * 40, "float": 1.5e-7}
    created = api_a.post(
        "/api/v1/jobs/wide.job/runs", {"payload": payload, "idempotencyKey": "9" * 30}
    )
    assert created.status_code == 201, created.text
    assert Run.objects.get().payload == payload
    (lease,) = leased(api_a, "wide")
    assert lease["payload"] == payload and lease["idempotencyKey"] == "9" * 30


def test_a_lease_answer_that_fails_to_build_leaves_every_run_of_the_batch_claimable(
    api_a, team_a, monkeypatch
):
    from apps.api import views_worker

    definition = make_definition(team_a, "fragile.job", queue="fragile")
    pks = add_ready_runs(definition, 5)
    built = []

    def lease_json_that_breaks(lease):
        built.append(lease.id)
        if len(built) == 3:
            raise RuntimeError("cannot render this lease")
        return original(lease)

    original = views_worker.lease_json
    monkeypatch.setattr(views_worker, "lease_json", lease_json_that_breaks)
    answer = api_a.post("/api/v1/leases", {"queues": ["fragile"], "max": 5, "workerId": "w"})
    assert answer.status_code == 500
    assert len(built) == 3  # the claim had taken runs when the answer failed
    assert set(Run.objects.filter(pk__in=pks).values_list("state", "attempt")) == {("scheduled", 0)}
    assert not Attempt.objects.exists()
    monkeypatch.setattr(views_worker, "lease_json", original)
    assert {lease["runId"] for lease in leased(api_a, "fragile")} == {
        public_run_id(pk) for pk in pks
    }


def test_a_claim_whose_worker_hangs_up_before_the_commit_is_rolled_back(team_a):
    import threading

    from apps.runs import leasing

    definition = make_definition(team_a, "gone.job", queue="gone")
    pks = add_ready_runs(definition, 3)
    gone = threading.Event()
    seen = []

    def render(leases):
        seen.append(len(leases))
        gone.set()  # the worker hangs up while its answer is being built
        return [lease.id for lease in leases]

    request = leasing.LeaseRequest(
        team_id=team_a.pk, team_ids=[team_a.pk], queues=["gone"], jobs=None, max_runs=3,
        worker_id="w", lease_seconds=60, wait_seconds=0,
    )  # fmt: skip
    assert leasing.claim_or_wait(request, render, gone=gone) == []
    assert seen[0] == 3
    assert set(Run.objects.filter(pk__in=pks).values_list("state", flat=True)) == {"scheduled"}


def test_a_run_whose_stored_payload_is_gone_fails_alone_and_holds_nothing_back(api_a, team_a):
    from apps.runs import payloads

    make_definition(team_a, "blob.job", queue="blobs")
    big = {"text": "x" * 6000}
    made = api_a.post("/api/v1/jobs/blob.job/runs", {"idempotencyKey": "big", "payload": big})
    small = api_a.post("/api/v1/jobs/blob.job/runs", {"idempotencyKey": "small"})
    assert (made.status_code, small.status_code) == (201, 201)
    broken = Run.objects.get(idempotency_key="big")
    assert broken.payload_key  # kept in storage, not inline
    payloads._storage().delete(broken.payload_key)  # a storage that lost it

    # The queue's other run is leased; the broken one fails, retryable, saying why.
    (lease,) = leased(api_a, "blobs")
    assert lease["runId"] == small.json()["runId"]
    broken.refresh_from_db()
    assert (broken.state, broken.attempt) == ("retrying", 1)
    assert broken.last_error["type"] == "PayloadUnavailable"
    assert broken.payload_key in broken.last_error["message"]

    # It is still shown and cancelled, without its payload.
    run_id = made.json()["runId"]
    shown = api_a.get(f"/api/v1/runs/{run_id}")
    assert shown.status_code == 200 and shown.json()["payload"] is None
    cancelled = api_a.post(f"/api/v1/runs/{run_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert Run.objects.get(pk=broken.pk).state == "cancelled"
    # Sent again, the same payload is stored again under its content's key: the run reads whole.
    again = api_a.post("/api/v1/jobs/blob.job/runs", {"idempotencyKey": "big", "payload": big})
    assert again.status_code == 200 and again.json()["payload"] == big
    assert Run.objects.count() == 2


def test_a_change_that_needs_a_stored_payload_it_cannot_read_is_a_503_and_changes_nothing(api_a):
    from apps.runs import payloads

    big = {"text": "y" * 6000}
    assert api_a.post("/api/v1/jobs", {"name": "blob.def", "payload": big}).status_code == 201
    definition = JobDefinition.objects.get(name="blob.def")
    payloads._storage().delete(definition.payload_key)
    # A PATCH keeps the payload it is not given: it cannot without reading it.
    changed = api_a.patch("/api/v1/jobs/blob.def", {"queue": "elsewhere"})
    assert assert_problem(changed, 503)["type"].endswith("/payload-unavailable")
    assert changed.headers["Retry-After"] == "1"
    assert definition.payload_key in changed.json()["detail"]
    assert "/" + "work/" not in changed.text  # the storage's own paths stay in the log
    assert JobDefinition.objects.get(name="blob.def").queue == definition.queue
    assert not AuditEvent.objects.filter(action="job.update").exists()


# --- 2. Bulk filters -------------------------------------------------------------------------


def dead_runs(team, count: int = 3, name: str = "filter.job") -> list[int]:
    definition = make_definition(team, name, queue="dlq")
    pks = add_ready_runs(definition, count)
    Run.objects.filter(pk__in=pks).update(state="dead")
    return pks


@pytest.mark.parametrize("action", ["requeue", "discard"])
@pytest.mark.parametrize(
    "flt",
    [
        {},
        {"job": None},
        {"job": ""},
        {"job": False},
        {"job": []},
        {"job": 0},
        {"queue": None},
        {"queue": ""},
        {"queue": {}},
        {"since": None},
        {"since": ""},
        {"since": "yesterday"},
        {"since": 1700000000},
        {"all": False},
        {"all": "true"},
        {"all": True, "job": "filter.job"},
        {"everything": True},
    ],
)
def test_a_bulk_filter_with_an_empty_or_mistyped_field_is_refused_and_changes_nothing(
    api_a, team_a, action, flt
):
    pks = dead_runs(team_a)
    answer = api_a.post(f"/api/v1/dlq/{action}", {"filter": flt})
    assert_problem(answer, 400)
    assert set(Run.objects.filter(pk__in=pks).values_list("state", flat=True)) == {"dead"}


def test_acting_on_every_dead_run_is_said_outright_with_all_true(api_a, api_b, team_a, team_b):
    mine = dead_runs(team_a)
    theirs = dead_runs(team_b, name="other.job")
    answer = api_a.post("/api/v1/dlq/discard", {"filter": {"all": True}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["count"] == len(mine)
    assert set(Run.objects.filter(pk__in=mine).values_list("state", flat=True)) == {"cancelled"}
    assert set(Run.objects.filter(pk__in=theirs).values_list("state", flat=True)) == {"dead"}


def test_a_bulk_filter_by_job_acts_on_that_job_only(api_a, team_a):
    chosen = dead_runs(team_a, name="filter.chosen")
    other = dead_runs(team_a, name="filter.other")
    answer = api_a.post("/api/v1/dlq/requeue", {"filter": {"job": "filter.chosen"}})
    assert answer.json()["count"] == len(chosen)
    assert set(Run.objects.filter(pk__in=other).values_list("state", flat=True)) == {"dead"}


# --- 3. Names --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("queues", ["reports/daily"]),
        ("queues", ["a b"]),
        ("queues", ["-leading-dash"]),
        ("queues", ["x" * 101]),
        ("queues", ["<script>"]),
        ("jobs", ["Billing.Export"]),
        ("jobs", ["billing/export"]),
        ("workerId", "host\n1"),
        ("workerId", "host\t1"),
        ("workerId", "héllo"),
        ("workerId", "x" * 201),
    ],
)
def test_a_lease_request_with_a_name_a_definition_could_not_have_is_refused(
    api_a, team_a, field, value
):
    make_definition(team_a, "names.job", queue="names")
    body = {"queues": ["names"], "workerId": "w", field: value}
    assert_problem(api_a.post("/api/v1/leases", body), 400)
    assert not Queue.objects.filter(team=team_a).exclude(name="names").exists()


def test_lease_calls_for_queues_no_definition_uses_create_no_queue_rows(api_a, team_a):
    make_definition(team_a, "used.job", queue="used")
    from apps.runs import activity

    for index in range(30):
        activity._last_written.clear()  # as if each call came to a fresh web process
        queues = [f"made-up-{index}-{n}" for n in range(99)]
        assert (
            api_a.post(
                "/api/v1/leases", {"queues": [*queues, "used"], "workerId": f"w{index}"}
            ).status_code
            == 200
        )
    assert list(Queue.objects.filter(team=team_a).values_list("name", flat=True)) == ["used"]
    assert api_a.get("/api/v1/queues").status_code == 200


# --- 4. Audit amplification ------------------------------------------------------------------


def test_a_batch_naming_a_run_twice_is_refused(api_a, team_a):
    definition = make_definition(team_a, "twice.job", queue="twice")
    add_ready_runs(definition, 1)
    (lease,) = leased(api_a, "twice")
    item = {"runId": lease["runId"], "fencingToken": lease["fencingToken"]}
    assert_problem(api_a.post("/api/v1/heartbeats", {"leases": [item] * 2}), 400, "leases[1].runId")
    result = {**item, "outcome": "succeeded"}
    assert_problem(
        api_a.post("/api/v1/results", {"results": [result, result]}), 400, "results[1].runId"
    )
    assert Run.objects.get().state == "leased"


def test_denials_are_recorded_once_per_request_however_many_runs_it_names(
    api_a, api_b, team_a, team_b
):
    definition = make_definition(team_b, "their.job", queue="theirs")
    pks = add_ready_runs(definition, 50)
    items = [{"runId": public_run_id(pk), "fencingToken": 1} for pk in pks]
    answer = api_a.post("/api/v1/heartbeats", {"leases": items})
    assert [item["status"] for item in answer.json()["leases"]] == [404] * 50
    (event,) = AuditEvent.objects.filter(team=team_b, action="access.denied")
    assert event.after["count"] == 50
    assert len(event.after["targets"]) == 20
    # The DLQ actions by id too.
    Run.objects.filter(pk__in=pks).update(state="dead")
    ids = [public_run_id(pk) for pk in pks]
    assert api_a.post("/api/v1/dlq/requeue", {"runIds": ids}).json()["count"] == 0
    assert AuditEvent.objects.filter(team=team_b, action="access.denied").count() == 2


# --- 6. Run times ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "run_at",
    ["0001-01-01T00:00:00Z", "1970-01-01T00:00:00Z", "9999-06-01T00:00:00Z"],
)
def test_a_run_time_outside_the_window_is_refused(api_a, team_a, run_at):
    make_definition(team_a, "when.job", queue="when")
    answer = api_a.post("/api/v1/jobs/when.job/runs", {"runAt": run_at})
    assert_problem(answer, 400, "runAt")
    assert not Run.objects.exists()


def test_a_run_time_more_than_a_day_ago_is_refused_and_within_it_accepted(api_a, team_a):
    make_definition(team_a, "when.job", queue="when")
    now = db_now()
    too_old = (now - timedelta(days=1, minutes=1)).isoformat()
    recent = (now - timedelta(hours=23)).isoformat()
    assert_problem(api_a.post("/api/v1/jobs/when.job/runs", {"runAt": too_old}), 400, "runAt")
    assert api_a.post("/api/v1/jobs/when.job/runs", {"runAt": recent}).status_code == 201


def test_lateness_metrics_are_labelled_by_team(api_a, api_b, team_a, team_b):
    for team, api in ((team_a, api_a), (team_b, api_b)):
        definition = make_definition(team, f"{team.slug}.shared", queue="shared")
        add_ready_runs(definition, 1, age_seconds=5)
        assert len(leased(api, "shared")) == 1
    text = api_a.get("/metrics").text
    for team in (team_a, team_b):
        label = f'scheduler_due_to_start_seconds_count{{priority="default",queue="shared",team="{team.slug}"}}'
        assert any(line.startswith(label) for line in text.splitlines()), label


# --- 9. Small promises -----------------------------------------------------------------------


def test_the_same_idempotency_key_with_a_different_payload_is_a_conflict_naming_the_fields(
    api_a, team_a
):
    make_definition(team_a, "idem.job", queue="idem")
    body = {"idempotencyKey": "order-991", "payload": {"amount": 10, "currency": "EUR"}}
    first = api_a.post("/api/v1/jobs/idem.job/runs", body)
    assert first.status_code == 201
    again = api_a.post("/api/v1/jobs/idem.job/runs", body)
    assert again.status_code == 200 and again.json()["runId"] == first.json()["runId"]
    changed = {**body, "payload": {"amount": 12, "currency": "EUR"}}
    problem = assert_problem(api_a.post("/api/v1/jobs/idem.job/runs", changed), 409)
    assert "amount" in problem["detail"] and "currency" not in problem["detail"]
    assert problem["type"].endswith("/idempotency-conflict")
    assert Run.objects.count() == 1
    assert Run.objects.get().payload == body["payload"]


def test_a_put_without_a_queue_creates_nothing(api_a):
    assert_problem(api_a.put("/api/v1/jobs/empty.job", {}), 400, "queue")
    assert_problem(api_a.put("/api/v1/jobs/empty.job", None), 400)
    assert not JobDefinition.objects.exists()
    assert api_a.put("/api/v1/jobs/empty.job", {"queue": "default"}).status_code == 201


def test_a_stale_token_conflict_does_not_disclose_the_current_token(api_a, team_a):
    definition = make_definition(team_a, "stale.job", queue="stale")
    (pk,) = add_ready_runs(definition, 1)
    (first,) = leased(api_a, "stale")
    Run.objects.filter(pk=pk).update(state="ready", lease_expires_at=None)
    (second,) = leased(api_a, "stale")
    assert second["fencingToken"] > first["fencingToken"]
    for path, extra in (("heartbeat", {}), ("complete", {}), ("fail", {"error": {"message": "x"}})):
        answer = api_a.post(
            f"/api/v1/runs/{first['runId']}/{path}",
            {"fencingToken": first["fencingToken"], **extra},
        )
        problem = assert_problem(answer, 409)
        assert "stale" in problem["detail"]
        assert not re.search(rf"\b{second['fencingToken']}\b", problem["detail"])
    batch = api_a.post(
        "/api/v1/heartbeats",
        {"leases": [{"runId": first["runId"], "fencingToken": first["fencingToken"]}]},
    )
    (item,) = batch.json()["leases"]
    assert item["status"] == 409
    assert not re.search(rf"\b{second['fencingToken']}\b", item["detail"])


def test_a_failure_with_a_stack_trace_is_kept_and_a_huge_one_cut_not_refused(api_a, team_a):
    definition = make_definition(team_a, "stack.job", queue="stack", retry_max_attempts=5)
    add_ready_runs(definition, 2)
    first, second = leased(api_a, "stack")
    stack = "Traceback (most recent call last):\n" + "  frame\n" * 20 + "ValueError: boom"
    for lease, trace in ((first, stack), (second, "x" * 200_000 + "ValueError: end")):
        answer = api_a.post(
            f"/api/v1/runs/{lease['runId']}/fail",
            {
                "fencingToken": lease["fencingToken"],
                "error": {"message": "boom", "type": "ValueError", "stack": trace},
            },
        )
        assert answer.status_code == 200, answer.text
    kept = api_a.get(f"/api/v1/runs/{first['runId']}").json()["lastError"]
    assert kept == {"message": "boom", "type": "ValueError", "stack": stack}
    cut = api_a.get(f"/api/v1/runs/{second['runId']}").json()["lastError"]["stack"]
    assert len(cut) == 64 * 1024 and cut.endswith("ValueError: end")


# --- 10. Names, keys and numbers as sent -------------------------------------------------------


@pytest.mark.parametrize("name", ["job%00x", "a.job%0A", "Upper.Case", "a%20job"])
def test_a_job_path_that_is_no_job_name_is_a_400_on_put_and_a_404_elsewhere(api_a, name):
    answer = api_a.put(f"/api/v1/jobs/{name}", {"queue": "q", "schedule": {}})
    assert_problem(answer, 400, "name")
    assert_problem(api_a.get(f"/api/v1/jobs/{name}"), 404)
    assert_problem(api_a.post(f"/api/v1/jobs/{name}/trigger", {}), 404)
    assert not JobDefinition.objects.exists()


def test_keys_and_worker_ids_are_taken_as_sent_not_trimmed(api_a, team_a):
    make_definition(team_a, "keys.job", queue="keys")
    plain = api_a.post("/api/v1/jobs/keys.job/runs", {"idempotencyKey": "k1"})
    spaced = api_a.post("/api/v1/jobs/keys.job/runs", {"idempotencyKey": " k1 "})
    assert (plain.status_code, spaced.status_code) == (201, 201), spaced.text
    assert spaced.json()["idempotencyKey"] == " k1 "
    assert spaced.json()["runId"] != plain.json()["runId"]
    # A worker id's rule (no leading or trailing space) holds, rather than the id trimmed.
    lease = {"queues": ["keys"], "max": 1, "workerId": " host-1 "}
    assert_problem(api_a.post("/api/v1/leases", lease), 400, "workerId")
    assert not Run.objects.filter(state="leased").exists()


def test_run_filters_follow_the_name_rules(api_a):
    answer = api_a.get("/api/v1/runs", params={"job": "NOT A JOB", "queue": "-bad"})
    body = assert_problem(answer, 400)
    assert {"job", "queue"} <= set(body["errors"])
    assert_problem(api_a.get("/api/v1/dlq", params={"job": "x" * 201}), 400, "job")
    assert api_a.get("/api/v1/runs", params={"job": "a.job", "queue": "q:1"}).status_code == 200


@pytest.mark.parametrize("number", ["\uff15", " 5", "5_0", "+5", "9" * 5000])
def test_query_numbers_are_ascii_digits(api_a, team_a, number):
    make_definition(team_a, "count.job", queue="count", schedule={"cron": "* * * * *"})
    assert_problem(api_a.get("/api/v1/runs", params={"limit": number}), 400, "limit")
    answer = api_a.get("/api/v1/jobs/count.job/preview", params={"count": number})
    assert_problem(answer, 400, "count")


def test_a_trigger_reads_its_body(api_a, team_a):
    make_definition(team_a, "trig.job", queue="trig", payload={"from": "job"})
    assert_problem(api_a.post("/api/v1/jobs/trig.job/trigger", {"bogus": 1}), 400, "bogus")
    broken = api_a.post(
        "/api/v1/jobs/trig.job/trigger",
        content=b"{bad",
        headers={"Content-Type": "application/json"},
    )
    assert assert_problem(broken, 400, "body")["type"].endswith("/parse-error")
    assert not Run.objects.exists()
    default = api_a.post("/api/v1/jobs/trig.job/trigger")
    given = api_a.post("/api/v1/jobs/trig.job/trigger", {"payload": {"from": "call"}})
    assert (default.status_code, given.status_code) == (201, 201), given.text
    assert default.json()["payload"] == {"from": "job"}
    assert given.json()["payload"] == {"from": "call"}


def test_a_refused_batch_item_is_the_single_calls_problem(api_a, team_a):
    definition = make_definition(team_a, "items.job", queue="items")
    add_ready_runs(definition, 1)
    (lease,) = leased(api_a, "items")
    stale = {"runId": lease["runId"], "fencingToken": lease["fencingToken"] + 1}
    token = {"fencingToken": stale["fencingToken"]}
    single = api_a.post(f"/api/v1/runs/{lease['runId']}/heartbeat", token).json()
    nobody = public_run_id(Run.objects.get().pk + 1_000_000)
    item = {**stale, "outcome": "succeeded"}
    answer = api_a.post(
        "/api/v1/results",
        {"results": [item, {**item, "runId": nobody}]},
    )
    conflict, missing = answer.json()["results"]
    assert {k: conflict[k] for k in ("type", "title", "status")} == {
        k: single[k] for k in ("type", "title", "status")
    }
    assert conflict["type"].endswith("/conflict") and conflict["runId"] == lease["runId"]
    assert missing["type"].endswith("/not-found") and missing["title"] == "Not found"
    assert missing["status"] == 404


def test_problem_types_are_spelled_one_way(api_a, live_server):
    import httpx

    types = [
        api_a.get("/api/v1/jobs/no.such-job").json()["type"],
        api_a.get("/api/v1/no-such-route").json()["type"],
        httpx.get(f"{live_server.url}/api/v1/jobs").json()["type"],
        api_a.post("/api/v1/runs", {"runs": [{"job": "no.such-job"}]}).json()["runs"][0]["type"],
    ]
    assert all("_" not in kind for kind in types), types
    assert types[0].endswith("/not-found") and types[1].endswith("/not-found")
    assert types[3].endswith("/not-found")


def test_a_queue_put_states_its_rate_limit(api_a, team_a):
    make_definition(team_a, "rate.job", queue="rq")
    limit = {"count": 3, "periodSeconds": 60}
    assert api_a.put("/api/v1/queues/rq", {"rateLimit": limit}).status_code == 200
    for body in ({}, {"paused": False}):
        assert_problem(api_a.put("/api/v1/queues/rq", body), 400, "rateLimit")
    assert Queue.objects.get(name="rq").rate_limit_count == 3


def test_a_dlq_action_on_no_ids_is_refused(api_a):
    for action in ("requeue", "discard"):
        assert_problem(api_a.post(f"/api/v1/dlq/{action}", {"runIds": []}), 400, "runIds")


def test_a_preview_names_a_job_and_writes_one_instant_twice(api_a):
    bad = {"name": "NOT A JOB", "schedule": {"cron": "0 2 * * *"}}
    assert_problem(api_a.post("/api/v1/preview", bad), 400, "name")
    answer = api_a.post("/api/v1/preview", {"schedule": {"delaySeconds": 300}})
    (time,) = answer.json()["times"]
    from datetime import datetime

    local = datetime.fromisoformat(time["local"])
    utc = datetime.fromisoformat(time["utc"].replace("Z", "+00:00"))
    assert local == utc, time


def test_a_call_that_takes_no_body_refuses_one(api_a, team_a):
    make_definition(team_a, "nobody.job", queue="nobody")
    channel = api_a.post(
        "/api/v1/channels",
        {"name": "mail", "kind": "email", "target": "ops@example.com", "events": ["run.dead"]},
    ).json()
    calls = [
        "/api/v1/jobs/nobody.job/pause",
        "/api/v1/queues/nobody/pause",
        f"/api/v1/channels/{channel['id']}/test",
    ]
    for path in calls:
        for body in ({"reason": "x"}, [1], "x"):
            assert_problem(api_a.post(path, body), 400, "body")
        broken = api_a.post(path, content=b"[[[[", headers={"Content-Type": "application/json"})
        assert_problem(broken, 400, "body")
    assert not JobDefinition.objects.get().paused
    deleting = api_a.http.request("DELETE", "/api/v1/jobs/nobody.job", json={"force": True})
    assert_problem(deleting, 400, "body")
    # No body, or an empty object, as clients send by habit.
    assert api_a.post(calls[0]).json()["paused"] is True
    assert api_a.post("/api/v1/jobs/nobody.job/resume", {}).json()["paused"] is False


@pytest.mark.parametrize(
    ("query", "host", "says"),
    [
        ({}, "evil.example", "The Host header names no host"),
        ({f"z{n}": "1" for n in range(1001)}, "testserver", "More than 1000 query parameters"),
    ],
)
def test_what_django_refuses_before_any_view_is_a_problem_under_the_api(
    db, settings, query, host, says
):
    from django.test import Client

    settings.ALLOWED_HOSTS = ["testserver"]
    answer = Client().get("/api/v1/jobs", query, HTTP_HOST=host)
    assert_problem(answer, 400, "body")
    assert says in answer.json()["detail"]


@pytest.mark.parametrize("encoding", ["gzip", "br"])
def test_a_body_under_a_content_encoding_is_refused_and_creates_nothing(api_a, team_a, encoding):
    import gzip

    make_definition(team_a, "enc.job", queue="enc")
    body = b'{"idempotencyKey": "k"}'
    for sent in (gzip.compress(body), body):
        answer = api_a.post(
            "/api/v1/jobs/enc.job/runs",
            content=sent,
            headers={"Content-Type": "application/json", "Content-Encoding": encoding},
        )
        assert assert_problem(answer, 415)["detail"].startswith(f"Content-Encoding '{encoding}'")
    assert not Run.objects.exists()
    identity = api_a.post(
        "/api/v1/jobs/enc.job/runs",
        content=body,
        headers={"Content-Type": "application/json", "Content-Encoding": "identity"},
    )
    assert identity.status_code == 201


@pytest.mark.parametrize("charset", ["utf-16", "latin-1", ""])
def test_a_body_in_a_charset_other_than_utf8_is_refused_and_creates_nothing(api_a, team_a, charset):
    make_definition(team_a, "charset.job", queue="charset")
    body = '{"idempotencyKey": "k"}'
    for path in ("/api/v1/jobs/charset.job/runs", "/api/v1/leases"):
        answer = api_a.post(
            path,
            content=body.encode(charset or "utf-8"),
            headers={"Content-Type": f"application/json; charset={charset}"},
        )
        assert assert_problem(answer, 415)["detail"].startswith(f"charset '{charset}'")
    assert not Run.objects.exists()
    for declared in ("UTF-8", "utf8", '"utf-8"', "us-ascii"):
        created = api_a.post(
            "/api/v1/jobs/charset.job/runs",
            content=body.encode(),
            headers={"Content-Type": f"application/json; charset={declared}"},
        )
        assert created.status_code in (200, 201), created.text
    assert Run.objects.count() == 1


@pytest.mark.parametrize("around", [("", "\n"), (" ", ""), ("", "\t"), ("", " ")])
def test_a_time_is_taken_as_sent_not_trimmed(api_a, team_a, around):
    job = make_definition(team_a, "times.job", queue="times")
    (dead,) = add_ready_runs(job, 1, prefix="dead")
    Run.objects.filter(pk=dead).update(state="dead")
    sent = around[0] + (db_now() + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ") + around[1]

    assert_problem(api_a.get("/api/v1/runs", params={"since": sent}), 400, "since")
    assert_problem(api_a.get("/api/v1/dlq", params={"since": sent}), 400, "since")
    discard = api_a.post("/api/v1/dlq/discard", {"filter": {"since": sent}})
    assert discard.status_code == 400, discard.text
    assert_problem(api_a.post("/api/v1/jobs/times.job/runs", {"runAt": sent}), 400)
    cron = {"cron": "0 2 * * *", "startAt": sent}
    assert_problem(api_a.post("/api/v1/preview", {"name": "times.job", "schedule": cron}), 400)
    preview = {"name": "times.job", "schedule": {"cron": "0 2 * * *"}, "from": sent}
    assert_problem(api_a.post("/api/v1/preview", preview), 400)
    assert_problem(
        api_a.put("/api/v1/jobs/times.other", {"queue": "t", "schedule": {"runAt": sent}}), 400
    )
    assert Run.objects.get(pk=dead).state == "dead"
    assert Run.objects.count() == 1 and not JobDefinition.objects.filter(name="times.other")


# --- keys given twice ------------------------------------------------------------------------

JSON = {"Content-Type": "application/json"}


def test_a_key_given_twice_is_refused_naming_it_and_nothing_is_written(api_a, team_a):
    """JSON leaves a key given twice to each reader (this server took the last): a definition
    sent with two queues was saved with the second, where the jobs file refuses it."""
    answer = api_a.http.put(
        "/api/v1/jobs/twice.job", content=b'{"queue": "first", "queue": "second"}', headers=JSON
    )
    problem = assert_problem(answer, 400, "queue")
    assert problem["errors"]["queue"] == ['The key "queue" is given twice in one object.']
    assert not JobDefinition.objects.filter(name="twice.job").exists()
    # Inside a payload too, named down to its object; spaces around the colon change nothing.
    nested = b'{"queue": "q", "payload": {"a": {"b": 1, "b" :2}}}'
    problem = assert_problem(
        api_a.http.put("/api/v1/jobs/twice.job", content=nested, headers=JSON), 400
    )
    assert 'The key "b" is given twice in one object.' in str(problem["errors"])
    # The same key in two objects, and a key's text inside a string, are not given twice.
    fine = b'{"queue": "q", "payload": {"a": {"b": 1}, "c": {"b": "\\"b\\": 2"}}}'
    assert api_a.http.put("/api/v1/jobs/twice.job", content=fine, headers=JSON).status_code == 201


def test_a_batch_item_giving_a_key_twice_is_refused_alone(api_a, team_a):
    make_definition(team_a, "twice.job", queue="twice")
    body = (
        b'{"runs": [{"job": "twice.job", "idempotencyKey": "before"},'
        b' {"job": "twice.job", "idempotencyKey": "bad", "payload": {"n": 1, "n": 2}},'
        b' {"job": "twice.job", "idempotencyKey": "after"}]}'
    )
    answer = api_a.http.post("/api/v1/runs", content=body, headers=JSON)
    assert answer.status_code == 200, answer.text
    before, bad, after = answer.json()["runs"]
    assert (before["status"], bad["status"], after["status"]) == (201, 400, 201)
    assert bad["errors"] == {"payload": ['The key "n" is given twice in one object.']}
    assert sorted(Run.objects.values_list("idempotency_key", flat=True)) == ["after", "before"]


def test_the_worker_protocol_takes_the_last_of_a_key_given_twice(api_a, team_a):
    """Its calls are not read a second time to look for keys given twice (parsers.
    keys_given_twice costs a twentieth of the web process's time a run there): the last is
    taken, as it always was."""
    job = make_definition(team_a, "twice.job", queue="twice")
    add_ready_runs(job, 1)
    body = b'{"queues": ["nothing"], "queues": ["twice"], "max": 5, "workerId": "w"}'
    answer = api_a.http.post("/api/v1/leases", content=body, headers=JSON)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["leases"]) == 1
