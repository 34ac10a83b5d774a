"""Reporting outcomes (the worker's and the Celery tasks'), against a scripted scheduler."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from cronlease_client.reporting import (
    RESULT_TOO_LARGE,
    LeasedRun,
    Report,
    describe_result,
    send_results,
)
from cronlease_client.transport import Transport

from tests.client.scripted import Request, Response, json_response

Answer = Callable[[list[dict]], Response]


@pytest.fixture
def scheduler(serve) -> Callable[[Answer], tuple[Transport, list[list[dict]]]]:
    """A Transport whose results requests get `answer(items)`; the items of each request."""

    def make(answer: Answer) -> tuple[Transport, list[list[dict]]]:
        requests: list[list[dict]] = []

        def handle(request: Request) -> Response:
            items = request.json()["results"]
            requests.append(items)
            return answer(items)

        return Transport(serve(handle).url, "jst_token", backoff_base=0.001), requests

    return make


def accepted(items: list[dict]) -> Response:
    return json_response(
        200, {"results": [{"runId": i["runId"], "status": 200, "state": "done"} for i in items]}
    )


def problem(code: int) -> Response:
    return json_response(code, {"status": code, "detail": f"answer {code}"})


def run(number: int) -> LeasedRun:
    return LeasedRun(f"run_{number}", "billing.export", 1, 10 + number)


def test_outcomes_go_in_one_request_with_their_fencing_tokens(scheduler):
    http, requests = scheduler(accepted)
    settled: list = []
    batch = [(run(1), Report("succeeded", {"rows": 3})), (run(2), Report("failed", message="x"))]

    assert send_results(http, batch, settled=settled.append) == {"run_1": "done", "run_2": "done"}
    assert [[(i["runId"], i["fencingToken"], i["outcome"]) for i in r] for r in requests] == [
        [("run_1", 11, "succeeded"), ("run_2", 12, "failed")]
    ]
    assert settled == [batch]


def test_a_refused_batch_is_sent_again_one_outcome_at_a_time(scheduler):
    http, requests = scheduler(lambda items: problem(400) if len(items) > 1 else accepted(items))
    settled: list = []
    batch = [(run(1), Report("succeeded")), (run(2), Report("succeeded"))]

    assert send_results(http, batch, settled=settled.append) == {"run_1": "done", "run_2": "done"}
    assert [[i["runId"] for i in r] for r in requests] == [["run_1", "run_2"], ["run_1"], ["run_2"]]
    assert settled == [[batch[0]], [batch[1]]]


def test_a_success_too_large_to_store_completes_without_its_result(scheduler):
    def answer(items: list[dict]) -> Response:
        return accepted(items) if items[0]["result"] == RESULT_TOO_LARGE.result else problem(413)

    http, requests = scheduler(answer)

    assert send_results(http, [(run(1), Report("succeeded", "x" * 100))]) == {"run_1": "done"}
    assert [r[0]["result"] for r in requests] == ["x" * 100, {"resultTooLarge": True}]


def test_a_request_the_scheduler_refuses_leaves_the_leases_to_expire(scheduler):
    http, requests = scheduler(lambda items: problem(409))
    settled: list = []
    batch = [(run(1), Report("succeeded"))]

    assert send_results(http, batch, settled=settled.append) == {}
    assert len(requests) == 1
    assert settled == [batch]


def test_an_outcome_the_scheduler_refuses_has_no_new_state(scheduler):
    def answer(items: list[dict]) -> Response:
        return json_response(
            200, {"results": [{"runId": "run_1", "status": 409, "detail": "stale token"}]}
        )

    http, _ = scheduler(answer)

    assert send_results(http, [(run(1), Report("succeeded"))]) == {}


@pytest.mark.parametrize(
    ("outcome", "state", "recorded"),
    [
        ("succeeded", "succeeded", True),
        ("failed", "retrying", True),
        ("failed", "dead", True),
        ("succeeded", "cancelled", True),
        ("succeeded", "retrying", False),  # not what this outcome leaves
        ("failed", "succeeded", False),
        ("succeeded", None, False),  # a stale token: no state named
    ],
)
def test_an_outcome_recorded_before_is_taken_and_not_warned_of(
    scheduler, caplog, outcome, state, recorded
):
    item = {"runId": "run_1", "status": 409, "detail": "the run is not leased"}
    if state:
        item["state"] = state
    http, _ = scheduler(lambda items: json_response(200, {"results": [item]}))
    report = Report("succeeded") if outcome == "succeeded" else Report("failed", message="x")

    with caplog.at_level("INFO", logger="cronlease_client"):
        states = send_results(http, [(run(1), report)])

    assert states == ({"run_1": state} if recorded else {})
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert [r.getMessage().split(" run_id")[0] for r in warned] == (
        [] if recorded else ["result refused"]
    )
    if recorded:
        assert "result already recorded run_id=run_1" in caplog.text


def test_an_item_answered_503_is_sent_again_alone_until_it_is_taken(scheduler):
    answers = iter(["down", "down", "up"])

    def answer(items: list[dict]) -> Response:
        if next(answers) == "down":
            return json_response(
                200,
                {
                    "results": [
                        {"runId": i["runId"], "status": 503, "detail": "shards 8-15 unavailable"}
                        if i["runId"] == "run_B"
                        else {"runId": i["runId"], "status": 200, "state": "succeeded"}
                        for i in items
                    ]
                },
            )
        return accepted(items)

    transport, requests = scheduler(answer)
    settled: list = []
    batch = [
        (LeasedRun("run_A", "j", 1, 7), Report("succeeded", 1)),
        (LeasedRun("run_B", "j", 1, 8), Report("succeeded", 2)),
    ]
    states = send_results(transport, batch, settled=settled.extend)
    assert states == {"run_A": "succeeded", "run_B": "done"}
    assert [[item["runId"] for item in items] for items in requests] == [
        ["run_A", "run_B"],
        ["run_B"],
        ["run_B"],
    ]
    assert [run.run_id for run, _ in settled] == ["run_A", "run_B"]  # once, at the end


def test_a_result_nested_past_what_python_can_write_is_stored_as_a_note_not_retried():
    value: list = []
    for _ in range(5000):
        value = [value]
    warned: list[str] = []

    class Log:
        def warning(self, message: str, *args: object) -> None:
            warned.append(message % args)

    report = describe_result(value, lambda: Log(), "handler")  # type: ignore[arg-type, return-value]
    assert report.outcome == "succeeded"
    assert report.result == {"unserializable": "<list nested too deep to show>"}
    assert warned == ["handler result is not JSON; storing its repr"]
