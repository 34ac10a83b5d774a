"""The worker protocol's plain validators agree with the serializers that document the bodies."""

from __future__ import annotations

import pytest
from rest_framework.exceptions import ValidationError

from apps.api import serializers as documented
from apps.api import worker_input
from apps.api.errors import flatten_errors

GOOD_ERROR = {"message": "boom", "type": "ValueError", "traceback": "..."}

CASES = [
    (
        worker_input.lease_request,
        documented.LeaseRequestSerializer,
        [
            {"queues": ["billing"], "workerId": "host/1"},
        {"queues": ["billing"], "workerId": "host/1", "jobs": ["billing.export"]},
        {"queues": ["billing"], "workerId": "host/1", "jobs": []},
            {
                "queues": ["a", "b"],
                "max": 100,
                "workerId": "w",
                "leaseSeconds": 30,
                "waitSeconds": 20,
            },
            {"queues": [], "workerId": "w"},
            {"queues": "billing", "workerId": "w"},
            {"queues": ["a"], "max": 0, "workerId": " "},
            {"queues": ["a"], "max": True, "workerId": "w", "leaseSeconds": "60"},
            {"queues": ["a"], "workerId": "w", "waitSeconds": 999, "extra": 1},
            {"workerId": "w"},
            [1, 2],
        ],
    ),
    (
        worker_input.complete_body,
        documented.CompleteSerializer,
        [
            {"fencingToken": 5},
            {"fencingToken": 5, "result": {"rows": 3}},
            {"fencingToken": "5"},
            {"fencingToken": 0},
            {},
            {"fencingToken": 5, "other": 1},
        ],
    ),
    (
        worker_input.fail_body,
        documented.FailSerializer,
        [
            {"fencingToken": 5, "error": GOOD_ERROR, "retryable": False},
            {"fencingToken": 5},
            {"fencingToken": 5, "error": "boom"},
            {"fencingToken": 5, "error": {"message": 3}},
            {"fencingToken": 5, "retryable": "no"},
            {"fencingToken": 5, "error": {"colour": "red"}},
        ],
    ),
    (
        worker_input.batch_heartbeats,
        documented.BatchHeartbeatSerializer,
        [
            {"leases": [{"runId": "run_1", "fencingToken": 1}]},
            {"leases": []},
            {"leases": [{"runId": "run_1"}, {"fencingToken": 2}, "x"]},
            {"leases": {"runId": "run_1"}},
            {},
        ],
    ),
    (
        worker_input.batch_results,
        documented.BatchResultSerializer,
        [
            {
                "results": [
                    {
                        "runId": "run_1",
                        "fencingToken": 1,
                        "outcome": "succeeded",
                        "result": {"n": 1},
                    }
                ]
            },
            {
                "results": [
                    {
                        "runId": "run_1",
                        "fencingToken": 1,
                        "outcome": "failed",
                        "error": GOOD_ERROR,
                        "retryable": True,
                    }
                ]
            },
            {"results": [{"runId": "run_1", "fencingToken": 1, "outcome": "maybe"}]},
            {
                "results": [
                    {"runId": "run_1", "fencingToken": -1, "outcome": "failed", "retryable": 1}
                ]
            },
            {"results": [{"fencingToken": 1, "outcome": "succeeded", "bonus": True}]},
            {"results": []},
        ],
    ),
]


def top_fields(detail) -> set[str]:
    # The validators name items precisely ("results[3].outcome"); the serializers' nesting is
    # coarser, so both are compared on the top-level field they blame.
    return {path.split(".")[0].split("[")[0] for path in flatten_errors(detail)}


def verdict_of_validator(validate, body):
    try:
        validate(body)
    except ValidationError as exc:
        return top_fields(exc.detail)
    return set()


def verdict_of_serializer(serializer_class, body):
    serializer = serializer_class(data=body)
    if serializer.is_valid():
        return set()
    return top_fields(serializer.errors)


@pytest.mark.parametrize(
    "validate,serializer_class,body",
    [(validate, serializer, body) for validate, serializer, bodies in CASES for body in bodies],
)
def test_same_verdict_and_same_fields(validate, serializer_class, body):
    assert verdict_of_validator(validate, body) == verdict_of_serializer(serializer_class, body)


def test_item_errors_name_the_item():
    with pytest.raises(ValidationError) as caught:
        worker_input.batch_results(
            {
                "results": [
                    {"runId": "run_1", "fencingToken": 1, "outcome": "succeeded"},
                    {"runId": "run_2", "outcome": "x"},
                ]
            }
        )
    assert set(flatten_errors(caught.value.detail)) == {
        "results[1].fencingToken",
        "results[1].outcome",
    }


def test_defaults_match():
    assert worker_input.lease_request({"queues": ["q"], "workerId": "w"}) == {
        "queues": ["q"],
        "jobs": None,
        "max": 1,
        "workerId": "w",
        "leaseSeconds": 60,
        "waitSeconds": 0,
    }
    assert worker_input.fail_body({"fencingToken": 3}) == {
        "fencingToken": 3,
        "error": {"message": "", "type": ""},
        "retryable": True,
    }
