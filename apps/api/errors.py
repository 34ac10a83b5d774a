"""Errors as problem details (RFC 9457): `{"type", "title", "status", "detail"}` plus `errors`."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import DisallowedHost, RequestDataTooBig, TooManyFieldsSent
from django.db import InterfaceError, OperationalError
from django.http import JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler

from apps.jobs.services import ChangedMeanwhile
from apps.runs import payloads, shards
from scheduler_site.database import RETRY_AFTER_SECONDS, failure_detail, log_failure

logger = logging.getLogger(__name__)

TYPE_BASE = "https://docs.cronlease.dev/problems/"

TITLES = {
    400: "Bad request",
    401: "Not authenticated",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    412: "Precondition failed",
    413: "Payload too large",
    406: "Not acceptable",
    415: "Unsupported media type",
    429: "Too many requests",
    500: "Internal server error",
    503: "Service unavailable",
}


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


class PreconditionFailed(exceptions.APIException):
    """The job is not at the version an If-Match names (or exists, for If-None-Match: *):
    nothing was changed. `etag`: the job's version now, sent back as its ETag."""

    status_code = status.HTTP_412_PRECONDITION_FAILED
    default_detail = "The job is not at the version the request names."
    default_code = "precondition-failed"

    def __init__(self, detail: str, etag: str | None = None) -> None:
        super().__init__(detail)
        self.etag = etag


class ShardUnavailable(exceptions.APIException):
    """The database of the run's shard cannot be reached (the detail names the shards)."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "The database of this run's shard cannot be reached."
    default_code = "shard-unavailable"


class DatabaseFailed(exceptions.APIException):
    """The database failed the request's statement or its commit (a lost connection, a
    serialization failure, a cancelled statement): what that transaction wrote is rolled back,
    and the same request may be sent again."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "The database failed this request; try again."
    default_code = "database-unavailable"


class PayloadUnavailable(exceptions.APIException):
    """A payload kept in storage that the request needs (to compare a retried enqueue's, to
    carry a definition's over) cannot be read; nothing was written, and the same request may
    be sent again."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "A payload kept in storage cannot be read; try again."
    default_code = "payload-unavailable"


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The payload is larger than the limit."
    default_code = "payload-too-large"


def problem(
    status_code: int, detail: str, *, code: str | None = None, errors: Any = None
) -> dict[str, Any]:
    # One spelling for every type: DRF's codes are written with underscores (`not_found`),
    # the titles and this project's codes with hyphens.
    name = (code or TITLES.get(status_code, "error")).lower().replace("_", "-").replace(" ", "-")
    body: dict[str, Any] = {
        "type": TYPE_BASE + name,
        "title": TITLES.get(status_code, "Error"),
        "status": status_code,
        "detail": detail,
    }
    if errors:
        body["errors"] = errors
    return body


def flatten_errors(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    """Turn DRF's nested error structure into {"retry.maxAttempts": ["…"]}."""
    flat: dict[str, list[str]] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = key if key != "non_field_errors" else ""
            path = f"{prefix}.{name}" if prefix and name else (prefix or name or "body")
            for sub_path, messages in flatten_errors(value, path).items():
                flat.setdefault(sub_path, []).extend(messages)
    elif isinstance(detail, list):
        if all(not isinstance(item, dict | list) for item in detail):
            flat[prefix or "body"] = [str(item) for item in detail]
        else:
            for index, item in enumerate(detail):
                for sub_path, messages in flatten_errors(item, f"{prefix}[{index}]").items():
                    flat.setdefault(sub_path, []).extend(messages)
    else:
        flat[prefix or "body"] = [str(detail)]
    return flat


def problem_exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, RequestDataTooBig):
        exc = PayloadTooLarge(
            f"The request body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes."
        )
    elif isinstance(exc, shards.Unavailable):
        exc = ShardUnavailable(str(exc))
    elif isinstance(exc, ChangedMeanwhile):
        exc = PreconditionFailed(
            "The job is not at the version If-Match names: another change was made since "
            "(its audit trail says which). Nothing was changed; its ETag now is its version.",
            f'"{exc.current}"',
        )
    elif isinstance(exc, payloads.Unavailable):
        logger.error("payload storage failure answered 503", exc_info=exc)
        exc = PayloadUnavailable(f"{exc}; try again.")
    elif isinstance(exc, OperationalError | InterfaceError):
        log_failure(exc, logger)
        exc = DatabaseFailed(failure_detail(exc))
    elif isinstance(exc, exceptions.UnsupportedMediaType):
        # DRF's own words for a body without a Content-Type were: Unsupported media type "".
        request = context.get("request")
        sent = request.META.get("CONTENT_TYPE", "") if request is not None else ""
        exc = exceptions.UnsupportedMediaType(
            sent,
            detail=f"The body is {sent[:60]!r}: send it as JSON, with Content-Type: "
            "application/json."
            if sent
            else "The body has no Content-Type: send it as JSON, with Content-Type: "
            "application/json.",
        )
    response = exception_handler(exc, context)
    if response is None:
        return None
    # The code given when raised (Conflict(detail, code="idempotency-conflict")), else the
    # exception's default.
    code = getattr(getattr(exc, "detail", None), "code", None) or getattr(exc, "default_code", None)
    if isinstance(exc, exceptions.ValidationError):
        errors = flatten_errors(exc.detail)
        fields = ", ".join(sorted(errors))
        body = problem(400, f"Invalid input: {fields}.", code="invalid-input", errors=errors)
    else:
        detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
        if isinstance(detail, dict | list):
            body = problem(
                response.status_code, "See errors.", code=code, errors=flatten_errors(detail)
            )
        else:
            # Every 400 names what is wrong: a body that is not JSON at all, the body.
            errors = {"body": [str(detail)]} if response.status_code == 400 else None
            body = problem(response.status_code, str(detail), code=code, errors=errors)
    response.data = body
    response.content_type = "application/problem+json"
    if isinstance(exc, DatabaseFailed | ShardUnavailable | PayloadUnavailable):
        response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    if isinstance(exc, PreconditionFailed) and exc.etag:
        response["ETag"] = exc.etag
    return response


def json_problem(status_code: int, detail: str, *, errors: Any = None) -> JsonResponse:
    return JsonResponse(
        problem(status_code, detail, errors=errors),
        status=status_code,
        content_type="application/problem+json",
    )


def bad_request(request, exception=None) -> JsonResponse:
    """What Django refuses before any view: a Host not in ALLOWED_HOSTS, more query parameters
    or form fields than it reads (DATA_UPLOAD_MAX_NUMBER_FIELDS)."""
    if isinstance(exception, DisallowedHost):
        detail = "The Host header names no host this server answers for."
    elif isinstance(exception, TooManyFieldsSent):
        detail = f"More than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} query parameters or fields."
    else:
        detail = "The request cannot be read."
    return json_problem(400, detail, errors={"body": [detail]})


def not_found(request, exception=None) -> JsonResponse:
    # A name or run id sent with an encoded slash (`/api/v1/jobs/a%2Fb`) reaches the router
    # decoded, as two segments that match no route: it is bad input, as other bad names are
    # (400), not a missing resource. The raw path is the ASGI server's (the web process's).
    raw_path = getattr(request, "scope", {}).get("raw_path") or b""
    if b"%2f" in raw_path.lower():
        detail = "A path segment holds an encoded slash (%2F): no name or run id contains '/'."
        return json_problem(400, detail, errors={"path": [detail]})
    return json_problem(404, "No such resource.")


def server_error(request) -> JsonResponse:
    return json_problem(500, "The server failed; the error has been logged.")
