"""Validation of the worker protocol's request bodies, without serializer objects.

The worker endpoints run thousands of times a second with batches of up to 1 000 items; DRF's
nested serializers cost about as much per item as the SQL itself, so these plain functions do
the same checks. The serializers in `serializers.py` still describe the bodies in the OpenAPI
schema, and `tests/api/test_worker_input.py` holds both to the same verdicts and field names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ValidationError

from apps.api.errors import PayloadTooLarge
from apps.api.parsers import payload_size
from apps.runs import limits

REQUIRED = "This field is required."
NOT_INT = "A valid integer is required."
NOT_BOOL = "Must be a valid boolean."
NOT_STR = "Not a valid string."
BLANK = "This field may not be blank."
UNKNOWN = "Unknown field."
NOT_OBJECT = "Expected a JSON object."
OUTCOMES = ("succeeded", "failed")
ERROR_EXTRA = frozenset({"traceback", "details"})


class Errors:
    def __init__(self) -> None:
        self.by_field: dict[str, list[str]] = {}

    def add(self, field: str, message: str) -> None:
        self.by_field.setdefault(field, []).append(message)

    def raise_if_any(self) -> None:
        if self.by_field:
            raise ValidationError(self.by_field)


def _object(data: Any, errors: Errors, path: str, allowed: frozenset[str]) -> dict | None:
    if not isinstance(data, dict):
        errors.add(path or "body", NOT_OBJECT)
        return None
    for key in data:
        if key not in allowed:
            errors.add(f"{path}.{key}" if path else key, UNKNOWN)
    return data


def _int(
    data: dict,
    key: str,
    errors: Errors,
    path: str,
    *,
    default: Any = REQUIRED,
    low: int | None = None,
    high: int | None = None,
) -> int | None:
    name = f"{path}.{key}" if path else key
    if key not in data:
        if default is REQUIRED:
            errors.add(name, REQUIRED)
        return None if default is REQUIRED else default
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        errors.add(name, NOT_INT)
        return None
    # Every integer here meets a PostgreSQL bigint (fencing tokens above all): past its range the
    # query would fail with a 500, so such a value is bad input like any other.
    high = min(high, 2**63 - 1) if high is not None else 2**63 - 1
    if low is not None and value < low:
        errors.add(name, f"Ensure this value is greater than or equal to {low}.")
    elif high is not None and value > high:
        errors.add(name, f"Ensure this value is less than or equal to {high}.")
    return value


def _str(
    data: dict,
    key: str,
    errors: Errors,
    path: str,
    *,
    max_length: int,
    required: bool = True,
    blank: bool = False,
    default: str = "",
) -> str | None:
    name = f"{path}.{key}" if path else key
    if key not in data:
        if required:
            errors.add(name, REQUIRED)
            return None
        return default
    value = data[key]
    if not isinstance(value, str):
        errors.add(name, NOT_STR)
        return None
    value = value.strip()
    if not value and not blank:
        errors.add(name, BLANK)
    elif len(value) > max_length:
        errors.add(name, f"Ensure this field has no more than {max_length} characters.")
    return value


def _bool(data: dict, key: str, errors: Errors, path: str, default: bool) -> bool:
    if key not in data:
        return default
    value = data[key]
    if not isinstance(value, bool):
        errors.add(f"{path}.{key}" if path else key, NOT_BOOL)
        return default
    return value


def _json(data: dict, key: str) -> Any:
    value = data.get(key)
    if value is not None and payload_size(value) > settings.SCHEDULER_PAYLOAD_MAX_BYTES:
        raise PayloadTooLarge(
            f"The {key} is larger than {settings.SCHEDULER_PAYLOAD_MAX_BYTES} bytes."
        )
    return value


def _error(data: dict, errors: Errors, path: str) -> dict[str, str]:
    name = f"{path}.error" if path else "error"
    raw = data.get("error")
    if raw is None:
        return {"message": "", "type": ""}
    body = _object(raw, errors, name, frozenset({"message", "type"}) | ERROR_EXTRA)
    if body is None:
        return {"message": "", "type": ""}
    return {
        "message": _str(body, "message", errors, name, max_length=10000, required=False, blank=True)
        or "",
        "type": _str(body, "type", errors, name, max_length=200, required=False, blank=True) or "",
    }


def _name(value: Any, field: str, problem_of: Callable[[Any], str | None], errors: Errors) -> None:
    problem = problem_of(value)
    if problem is not None:
        errors.add(field, problem)


def lease_request(data: Any) -> dict[str, Any]:
    errors = Errors()
    body = _object(
        data,
        errors,
        "",
        frozenset({"queues", "jobs", "max", "workerId", "leaseSeconds", "waitSeconds"}),
    )
    if body is None:
        errors.raise_if_any()
    queues = body.get("queues")
    if "queues" not in body:
        errors.add("queues", REQUIRED)
    elif not isinstance(queues, list):
        errors.add("queues", f'Expected a list of items but got type "{type(queues).__name__}".')
    elif not 1 <= len(queues) <= 100:
        errors.add("queues", "Give between 1 and 100 queues.")
    else:
        # The rules of a definition's queue: a name stored here appears in pages and metrics.
        for index, queue in enumerate(queues):
            _name(queue, f"queues[{index}]", limits.queue_name_problem, errors)
    jobs = body.get("jobs")
    if jobs is not None:
        if not isinstance(jobs, list) or not 1 <= len(jobs) <= 1000:
            errors.add("jobs", "A list of 1 to 1000 job names, or leave it out for every job.")
        else:
            for index, job in enumerate(jobs):
                _name(job, f"jobs[{index}]", limits.job_name_problem, errors)
    worker_id = body.get("workerId")
    if "workerId" not in body:
        errors.add("workerId", REQUIRED)
    else:
        _name(worker_id, "workerId", limits.worker_id_problem, errors)
    answer = {
        "queues": queues,
        "jobs": jobs,
        "max": _int(body, "max", errors, "", default=1, low=1, high=settings.SCHEDULER_MAX_CLAIM),
        "workerId": worker_id,
        "leaseSeconds": _int(body, "leaseSeconds", errors, "", default=60, low=1, high=86400),
        "waitSeconds": _int(
            body,
            "waitSeconds",
            errors,
            "",
            default=0,
            low=0,
            high=settings.SCHEDULER_MAX_WAIT_SECONDS,
        ),
    }
    errors.raise_if_any()
    return answer


def token_body(data: Any, extra: frozenset[str] = frozenset()) -> dict[str, Any]:
    errors = Errors()
    body = _object(data, errors, "", frozenset({"fencingToken"}) | extra)
    if body is None:
        errors.raise_if_any()
    answer: dict[str, Any] = {"fencingToken": _int(body, "fencingToken", errors, "", low=1)}
    if "result" in extra:
        answer["result"] = _json(body, "result")
    if "error" in extra:
        answer["error"] = _error(body, errors, "")
        answer["retryable"] = _bool(body, "retryable", errors, "", True)
    errors.raise_if_any()
    return answer


def complete_body(data: Any) -> dict[str, Any]:
    return token_body(data, frozenset({"result"}))


def fail_body(data: Any) -> dict[str, Any]:
    return token_body(data, frozenset({"error", "retryable"}))


def _items(data: Any, key: str, errors: Errors) -> list | None:
    body = _object(data, errors, "", frozenset({key}))
    if body is None:
        return None
    items = body.get(key)
    if key not in body:
        errors.add(key, REQUIRED)
    elif not isinstance(items, list):
        errors.add(key, f'Expected a list of items but got type "{type(items).__name__}".')
    elif not items:
        errors.add(key, "This list may not be empty.")
    elif len(items) > 1000:
        errors.add(key, "Ensure this field has no more than 1000 elements.")
    else:
        return items
    return None


def batch_heartbeats(data: Any) -> list[dict[str, Any]]:
    errors = Errors()
    items = _items(data, "leases", errors) or []
    answer = []
    for index, raw in enumerate(items):
        path = f"leases[{index}]"
        item = _object(raw, errors, path, frozenset({"runId", "fencingToken"}))
        if item is not None:
            answer.append(
                {
                    "runId": _str(item, "runId", errors, path, max_length=40),
                    "fencingToken": _int(item, "fencingToken", errors, path, low=1),
                }
            )
    _refuse_repeats(items, "leases", errors)
    errors.raise_if_any()
    return answer


def _refuse_repeats(items: list, key: str, errors: Errors) -> None:
    """One run, one item: a batch naming a run twice is refused (each item has one answer, and
    a repeated id would multiply the work, and the audit of a denied one)."""
    seen: set[str] = set()
    for index, item in enumerate(items):
        run_id = item.get("runId") if isinstance(item, dict) else None
        if not isinstance(run_id, str):
            continue
        run_id = run_id.strip()
        if run_id in seen:
            errors.add(f"{key}[{index}].runId", f"{run_id} appears earlier in this batch.")
        seen.add(run_id)


RESULT_FIELDS = frozenset({"runId", "fencingToken", "outcome", "result", "error", "retryable"})


def batch_results(data: Any) -> list[dict[str, Any]]:
    errors = Errors()
    items = _items(data, "results", errors) or []
    answer = []
    for index, raw in enumerate(items):
        path = f"results[{index}]"
        item = _object(raw, errors, path, RESULT_FIELDS)
        if item is None:
            continue
        outcome = item.get("outcome")
        if "outcome" not in item:
            errors.add(f"{path}.outcome", REQUIRED)
        elif outcome not in OUTCOMES:
            errors.add(f"{path}.outcome", f'"{outcome}" is not a valid choice.')
        answer.append(
            {
                "runId": _str(item, "runId", errors, path, max_length=40),
                "fencingToken": _int(item, "fencingToken", errors, path, low=1),
                "outcome": outcome,
                "result": _json(item, "result"),
                "error": _error(item, errors, path),
                "retryable": _bool(item, "retryable", errors, path, True),
            }
        )
    _refuse_repeats(items, "results", errors)
    errors.raise_if_any()
    return answer
