"""The OpenAPI description of the API (drf-spectacular): auth scheme, response shapes, helpers.

Documentation only: nothing here validates or renders a request. Request bodies and answers are
the shapes of `apps.api.shapes`; this module describes the problem details of `apps.api.errors`
and the parameters, and wraps answers with their problems. Imported from `ApiConfig.ready()`.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema_serializer
from rest_framework import serializers

from apps.runs import limits, workers
from apps.runs.models import State

PROBLEM_MEDIA_TYPE = "application/problem+json"

STATE_CHOICES = list(State.values)


# --- authentication -------------------------------------------------------------------------


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """`Authorization: Bearer <token>`: a team's API token with the `worker` and/or `manage` scope."""

    target_class = "apps.api.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        scheme = build_bearer_security_scheme_object(
            header_name="Authorization", token_prefix="Bearer"
        )
        scheme["description"] = (
            "A team's API token (shown once at creation). Worker endpoints need the `worker` "
            "scope, management endpoints the `manage` scope."
        )
        return scheme


# --- problem details ------------------------------------------------------------------------


@extend_schema_serializer(component_name="ProblemDetails")
class ProblemDetailsSerializer(serializers.Serializer):
    """An error, as problem details (RFC 9457), served as `application/problem+json`."""

    type = serializers.URLField(help_text="A URI naming the kind of problem.")
    title = serializers.CharField(help_text="A short summary of the kind of problem.")
    status = serializers.IntegerField(
        min_value=400, max_value=599, help_text="The HTTP status code."
    )
    detail = serializers.CharField(help_text="What went wrong with this request.")
    errors = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        required=False,
        help_text=(
            "Reasons per field, keyed by the field's path (`retry.maxAttempts`, "
            "`schedule.timeZone`, `leases[0].fencingToken`, `body`); present on a 400."
        ),
    )


PROBLEM_DESCRIPTIONS = {
    400: "Bad input: `errors` names every bad field and why.",
    401: "No token, or an unknown or revoked token.",
    403: "The token lacks the scope this endpoint needs.",
    404: "No such resource for the token's team.",
    409: "Conflict with the current state.",
    412: (
        "The job is not at the version `If-Match` names (its `ETag` is the version now): "
        "nothing was changed."
    ),
    503: "The database of the run's shard cannot be reached; the detail names the shards.",
    413: "The payload (or the request body) is larger than the limit.",
    415: "The request body is not `application/json`.",
    429: "Too many requests (throttled); retry later.",
}


def problems(*codes: int, **descriptions: str) -> dict:
    """Problem-details responses for `codes`; `descriptions` overrides by `e409=...` etc."""
    return {
        (code, PROBLEM_MEDIA_TYPE): OpenApiResponse(
            ProblemDetailsSerializer,
            description=descriptions.get(f"e{code}", PROBLEM_DESCRIPTIONS[code]),
        )
        for code in codes
    }


# Every authenticated endpoint can answer these; endpoints that read a JSON body add 400/413/415.
AUTH_PROBLEMS = (401, 403, 429)
BODY_PROBLEMS = (400, 413, 415)


SUCCESS_DESCRIPTIONS = {
    200: "OK",
    201: "Created",
    202: "Accepted",
    204: "No content",
    207: "Made in part: the answer says what was made and what was not",
}

# What any call may be refused with though its declaration does not say so: added to every
# operation by `declare_refusals` (SPECTACULAR_SETTINGS' POSTPROCESSING_HOOKS).
NOT_ACCEPTABLE = "The `Accept` header (or `?format=`) asks for a format other than JSON."
BODY_REFUSED = {
    "400": "A body was sent: this call takes none (an empty object `{}` is accepted).",
    "415": "A body was sent, and not as `application/json`.",
}
ANY_CALL_REFUSED = {
    "400": (
        "A query parameter the call does not take, or one given twice; a path segment no name "
        "can hold (an encoded `/`)."
    ),
    "413": "The request body is larger than the limit, whether or not the call reads one.",
}
# The headers that go with a status, whatever the call.
STATUS_HEADERS = {
    "401": {
        "WWW-Authenticate": {
            "description": "`Bearer`: how to authenticate.",
            "schema": {"type": "string"},
        }
    },
    "429": {
        "Retry-After": {
            "description": "Seconds to wait before trying again.",
            "schema": {"type": "integer", "minimum": 0},
        }
    },
    "412": {
        "ETag": {
            "description": "The job's version now (what `If-Match` must name).",
            "schema": {"type": "string"},
        }
    },
}
PREFERENCE_APPLIED = {
    "Preference-Applied": {
        "description": "The `Prefer` preference the answer honours (`return=minimal`).",
        "schema": {"type": "string"},
    }
}


def declare_refusals(result: dict, generator: Any, request: Any, public: bool) -> dict:
    """Every operation answers 406 to an `Accept` the API does not serve, 400 to a query
    parameter it does not take and 413 to a body past the limit; a call that takes no body
    (its view's `bodyless` methods) answers 400 or 415 to one sent all the same. The headers
    of a status (`Retry-After` of a 429…) are declared wherever it is."""
    bodyless = {
        (path, method.lower())
        for path, _, method, view in generator.endpoints
        if method in getattr(getattr(view, "cls", None), "bodyless", ())
    }
    refused = {"$ref": "#/components/schemas/ProblemDetails"}

    def problem(description: str) -> dict:
        return {"content": {PROBLEM_MEDIA_TYPE: {"schema": refused}}, "description": description}

    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            answers = operation.setdefault("responses", {})
            answers.setdefault("406", problem(NOT_ACCEPTABLE))
            if (path, method) in bodyless:
                for code, description in BODY_REFUSED.items():
                    answers.setdefault(code, problem(description))
            for code, description in ANY_CALL_REFUSED.items():
                answers.setdefault(code, problem(description))
            prefer = any(p.get("name") == "Prefer" for p in operation.get("parameters", ()))
            for code, answer in answers.items():
                headers = STATUS_HEADERS.get(code, {})
                if prefer and code.startswith("2"):
                    headers = {**headers, **PREFERENCE_APPLIED}
                if headers:
                    answer.setdefault("headers", {}).update(headers)
    return result


def responses(ok: dict, *codes: int, **descriptions: str) -> dict:
    """The success responses `ok` plus problem details for `codes` and the auth problems."""
    wanted = sorted(set(codes) | set(AUTH_PROBLEMS))
    success = {
        code: answer
        if isinstance(answer, OpenApiResponse)
        else OpenApiResponse(answer, description=SUCCESS_DESCRIPTIONS[code])
        for code, answer in ok.items()
    }
    return {**success, **problems(*wanted, **descriptions)}


# --- parameters -----------------------------------------------------------------------------

JOB_NAME = OpenApiParameter(
    "name",
    {"type": "string", "minLength": 1, "maxLength": 200},
    OpenApiParameter.PATH,
    required=True,
    description=(
        "The job's name: lowercase dotted words of letters, digits, `-` and `_`, "
        "e.g. `billing.export-invoices`."
    ),
)
IF_MATCH = OpenApiParameter(
    "If-Match",
    str,
    OpenApiParameter.HEADER,
    description=(
        "Change the job only if it is still at this version: the `ETag` a read or a change of "
        "it answered (`*`: any version). Compared under the job's lock; otherwise 412 and "
        "nothing is changed."
    ),
)
IF_NONE_MATCH = OpenApiParameter(
    "If-None-Match",
    str,
    OpenApiParameter.HEADER,
    description="`*`: create the job only, never replace one (412 if it exists).",
)
ETAG = OpenApiParameter(
    "ETag",
    str,
    OpenApiParameter.HEADER,
    response=[200, 201, 412],
    description=(
        "The job's version (of its own fields: not of `nextDueAt`, which the scheduler moves): "
        "what `If-Match` names to change only this version."
    ),
)
RUN_ID = OpenApiParameter(
    "run_id",
    {"type": "string", "minLength": 1},
    OpenApiParameter.PATH,
    required=True,
    description="The run's public id, e.g. `run_8K2`. An id that is not one of ours is a 404.",
)
PREVIEW_QUERY = [
    OpenApiParameter(
        "count",
        {"type": "integer", "minimum": 1, "maximum": 1000, "default": 10},
        description="How many fire times to show (1–1000).",
    ),
    OpenApiParameter(
        "from",
        OpenApiTypes.DATETIME,
        description="Show fire times strictly after this ISO 8601 time (with an offset or Z); "
        "default now.",
    ),
]


def page(cursor_is: str) -> list[OpenApiParameter]:
    """A list's `cursor` (what it holds) and `limit`."""
    return [
        OpenApiParameter(
            "cursor",
            str,
            description=f"The `cursor` of the `next` link of the previous page ({cursor_is}).",
        ),
        OpenApiParameter(
            "limit",
            {
                "type": "integer",
                "minimum": 1,
                "maximum": limits.PAGE_MAX,
                "default": limits.PAGE_DEFAULT,
            },
            description=f"Page size (1–{limits.PAGE_MAX}).",
        ),
    ]


RUN_FILTERS = [
    OpenApiParameter("job", str, description="Only runs of this job (exact name)."),
    OpenApiParameter("queue", str, description="Only runs of this queue."),
    OpenApiParameter(
        "since",
        OpenApiTypes.DATETIME,
        description="Only runs created at or after this ISO 8601 time (with an offset or Z).",
    ),
    *page("a run id"),
]
RUN_STATE = OpenApiParameter(
    "state",
    str,
    enum=STATE_CHOICES,
    description="Only runs in this state (`ready` means waiting and claimable now).",
)


# --- operations: why not running, queues ----------------------------------------------------


QUEUE_NAME = OpenApiParameter(
    "name",
    {"type": "string", "minLength": 1, "maxLength": 100},
    OpenApiParameter.PATH,
    required=True,
    description="The queue's name.",
)


# --- operations: workers --------------------------------------------------------------------

WORKER_MINUTES = OpenApiParameter(
    "minutes",
    {
        "type": "integer",
        "minimum": 1,
        "maximum": workers.MINUTES_MAX,
        "default": workers.MINUTES_DEFAULT,
    },
    description=f"Workers seen in this many last minutes (1–{workers.MINUTES_MAX}); a worker "
    "holding a leased run is listed whenever it was last seen.",
)
