"""The OpenAPI description of the API (drf-spectacular): auth scheme, response shapes, helpers.

Documentation only: nothing here validates or renders a request. The response serializers below
describe the dicts built by `run_json`, `definition_json`, `attempt_json` and `lease_json`, and the
problem details of `apps.api.errors`; the request bodies are the real request serializers of
`apps.api.serializers`, completed by the extensions at the end of this module (strict objects,
the schedule union, limits that live in validators or settings). Imported from `ApiConfig.ready()`.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import (
    OpenApiAuthenticationExtension,
    OpenApiSerializerExtension,
    OpenApiSerializerFieldExtension,
)
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema_serializer
from rest_framework import serializers

from apps.api import serializers as api
from apps.jobs import schedule as sched
from apps.runs.models import PRIORITIES, Outcome, State, Trigger

PROBLEM_MEDIA_TYPE = "application/problem+json"

PRIORITY_CHOICES = list(PRIORITIES)
STATE_CHOICES = list(State.values)
TRIGGER_CHOICES = list(Trigger.values)
OUTCOME_CHOICES = list(Outcome.values)
ITEM_STATUS_CHOICES = [200, 404, 409]

# Any JSON value but null, and any JSON value at all (payloads and results are the caller's).
ANY_JSON_NOT_NULL: dict[str, Any] = {
    "anyOf": [
        {"type": "object", "additionalProperties": True},
        {"type": "array", "items": {}},
        {"type": "string"},
        {"type": "number"},
        {"type": "boolean"},
    ],
    "description": "Any JSON value except null.",
}


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


SUCCESS_DESCRIPTIONS = {200: "OK", 201: "Created", 204: "No content"}


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
RUN_FILTERS = [
    OpenApiParameter("job", str, description="Only runs of this job (exact name)."),
    OpenApiParameter("queue", str, description="Only runs of this queue."),
    OpenApiParameter(
        "since",
        OpenApiTypes.DATETIME,
        description="Only runs created at or after this ISO 8601 time (with an offset or Z).",
    ),
    OpenApiParameter(
        "cursor",
        str,
        description="The `cursor` of the `next` link of the previous page (a run id).",
    ),
    OpenApiParameter(
        "limit",
        {"type": "integer", "minimum": 1, "maximum": 500, "default": 50},
        description="Page size (1–500).",
    ),
]
RUN_STATE = OpenApiParameter(
    "state",
    str,
    enum=STATE_CHOICES,
    description="Only runs in this state (`ready` means waiting and claimable now).",
)


# --- response shapes ------------------------------------------------------------------------


class AnyJSONField(serializers.JSONField):
    """A free JSON value in a response (payload, result)."""


@extend_schema_serializer(component_name="RunError")
class RunErrorSerializer(serializers.Serializer):
    """The error a worker reported, or the reaper's reason (`lease_expired`, `timed_out`)."""

    message = serializers.CharField(allow_blank=True, required=False)
    type = serializers.CharField(allow_blank=True, required=False)


@extend_schema_serializer(component_name="Retry")
class RetryPolicySerializer(serializers.Serializer):
    maxAttempts = serializers.IntegerField(min_value=1, max_value=1000)
    baseSeconds = serializers.IntegerField(min_value=0, max_value=86400)
    maxSeconds = serializers.IntegerField(min_value=0, max_value=7 * 86400)


@extend_schema_serializer(component_name="Definition")
class DefinitionResponseSerializer(serializers.Serializer):
    """A job definition."""

    name = serializers.CharField()
    team = serializers.CharField(help_text="The slug of the owning team.")
    schedule = api.ScheduleField(help_text="The schedule, with its defaults filled in.")
    queue = serializers.CharField()
    priority = serializers.ChoiceField(choices=PRIORITY_CHOICES)
    timeoutSeconds = serializers.IntegerField(min_value=1)
    retry = RetryPolicySerializer()
    concurrency = serializers.IntegerField(
        min_value=1, allow_null=True, help_text="Max leased runs at once; null = unlimited."
    )
    payload = AnyJSONField()
    paused = serializers.BooleanField()
    dryRun = serializers.BooleanField()
    latenessSloSeconds = serializers.IntegerField(allow_null=True, min_value=1)
    owner = serializers.CharField(allow_blank=True, help_text="Who to contact when it fails.")
    runbookUrl = serializers.CharField(allow_blank=True)
    nextDueAt = serializers.DateTimeField(allow_null=True)
    shard = serializers.IntegerField(min_value=0)
    missedRunsNote = serializers.CharField(
        allow_blank=True, help_text="What the last catch-up after an outage did, if anything."
    )
    createdAt = serializers.DateTimeField()
    updatedAt = serializers.DateTimeField()


@extend_schema_serializer(component_name="DefinitionList")
class DefinitionListSerializer(serializers.Serializer):
    results = DefinitionResponseSerializer(many=True)


@extend_schema_serializer(component_name="Run")
class RunResponseSerializer(serializers.Serializer):
    """A run: one concrete execution of a definition."""

    runId = serializers.CharField(help_text="The public id, `run_…`.")
    job = serializers.CharField()
    team = serializers.CharField(allow_null=True)
    queue = serializers.CharField()
    priority = serializers.ChoiceField(choices=PRIORITY_CHOICES)
    state = serializers.ChoiceField(choices=STATE_CHOICES)
    attempt = serializers.IntegerField(min_value=0)
    maxAttempts = serializers.IntegerField(min_value=0)
    dueAt = serializers.DateTimeField(help_text="The nominal time.")
    availableAt = serializers.DateTimeField(help_text="When it may be claimed.")
    idempotencyKey = serializers.CharField(allow_blank=True)
    fencingToken = serializers.IntegerField(allow_null=True)
    leaseExpiresAt = serializers.DateTimeField(allow_null=True)
    workerId = serializers.CharField(allow_null=True)
    trigger = serializers.ChoiceField(choices=TRIGGER_CHOICES)
    dryRun = serializers.BooleanField()
    payload = AnyJSONField(allow_null=True)
    result = AnyJSONField(allow_null=True)
    lastError = RunErrorSerializer(allow_null=True)
    createdAt = serializers.DateTimeField()
    startedAt = serializers.DateTimeField(allow_null=True)
    finishedAt = serializers.DateTimeField(allow_null=True)


@extend_schema_serializer(component_name="Attempt")
class AttemptResponseSerializer(serializers.Serializer):
    """One lease of a run."""

    attempt = serializers.IntegerField(min_value=1)
    fencingToken = serializers.IntegerField()
    workerId = serializers.CharField(allow_blank=True)
    leasedAt = serializers.DateTimeField()
    lastHeartbeatAt = serializers.DateTimeField(allow_null=True)
    endedAt = serializers.DateTimeField(allow_null=True)
    outcome = serializers.ChoiceField(choices=OUTCOME_CHOICES, allow_null=True)
    error = RunErrorSerializer(allow_null=True)


@extend_schema_serializer(component_name="RunDetail")
class RunDetailResponseSerializer(RunResponseSerializer):
    """A run with its attempts, oldest first."""

    attempts = AttemptResponseSerializer(many=True)


@extend_schema_serializer(component_name="RunPage")
class RunPageSerializer(serializers.Serializer):
    """A page of runs, newest first."""

    results = RunResponseSerializer(many=True)
    next = serializers.URLField(allow_null=True, help_text="The next page, or null on the last.")


@extend_schema_serializer(component_name="FireTime")
class FireTimeSerializer(serializers.Serializer):
    local = serializers.CharField(
        help_text="The nominal fire time in the definition's zone, ISO 8601 with its offset."
    )
    utc = serializers.DateTimeField(help_text="The same instant in UTC.")
    start = serializers.DateTimeField(help_text="The instant after the job's jitter.")
    note = serializers.CharField(
        allow_blank=True, help_text="Empty unless a DST change moved or repeated this time."
    )


@extend_schema_serializer(component_name="Preview")
class PreviewAnswerSerializer(serializers.Serializer):
    times = FireTimeSerializer(many=True)


@extend_schema_serializer(component_name="DlqActionAnswer")
class DlqActionAnswerSerializer(serializers.Serializer):
    count = serializers.IntegerField(min_value=0, help_text="How many runs changed.")
    runIds = serializers.ListField(child=serializers.CharField(), help_text="The runs changed.")


# --- request shapes -------------------------------------------------------------------------


class DefinitionPutSerializer(api.DefinitionSerializer):
    """The definition for PUT: the name comes from the path (a name in the body must match it)."""

    name = api.StrictCharField(max_length=200, required=False)


# Component names (before drf-spectacular's `Request` suffix) of the request serializers.
REQUEST_NAMES: dict[type, str] = {
    api.RunIdsOrFilterSerializer: "DlqSelection",
    api.PreviewSerializer: "SchedulePreview",
    DefinitionPutSerializer: "DefinitionReplace",
}

REQUEST_DESCRIPTIONS: dict[type, str] = {
    api.DefinitionSerializer: "A job definition; omitted fields take their defaults.",
    api.RetrySerializer: "The retry policy: attempts, and the full-jitter exponential backoff "
    "between them (`maxSeconds` ≥ `baseSeconds`).",
    api.CreateRunSerializer: "A delayed (`delaySeconds`) or one-off (`runAt`) run, at most one of "
    "the two; neither means now.",
    api.RunIdsOrFilterSerializer: "Give either `runIds` or `filter`, not both.",
    api.PreviewSerializer: "A schedule to preview; `name` sets the jitter.",
}

IGNORED_DEFINITION_FIELD = {
    "description": "Read-only: accepted and ignored, so a fetched definition can be sent back."
}


def _extra_properties(target: serializers.Serializer) -> dict[str, dict[str, Any]]:
    """Fields a request serializer accepts beyond its declared fields (see `ignored_fields`)."""
    if isinstance(target, api.DefinitionSerializer):
        return {name: dict(IGNORED_DEFINITION_FIELD) for name in sorted(target.ignored_fields)}
    if isinstance(target, api.PreviewSerializer):
        return {
            "from": {
                "type": "string",
                "format": "date-time",
                "description": "Show fire times strictly after this time (with an offset or Z); "
                "default now.",
            }
        }
    return {}


def _constraints(target: serializers.Serializer) -> dict[str, dict[str, Any]]:
    """Limits enforced by `validate_<field>` methods or settings rather than field arguments."""
    if isinstance(target, api.DefinitionSerializer):
        return {
            "name": {"pattern": api.NAME_RE.pattern},
            "queue": {"pattern": api.QUEUE_RE.pattern},
        }
    return {}


class StrictSerializerExtension(OpenApiSerializerExtension):
    """Request serializers refuse unknown fields: say so with `additionalProperties: false`."""

    target_class = api.StrictSerializer
    match_subclasses = True

    def get_name(self, auto_schema, direction):
        return REQUEST_NAMES.get(type(self.target))

    def map_serializer(self, auto_schema, direction):
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        properties = schema.setdefault("properties", {})
        for name, extra in _constraints(self.target).items():
            if name in properties:
                properties[name].update(extra)
        for name, field in self.target.fields.items():
            # Nested `many=True` serializers check their length in to_internal_value.
            if isinstance(field, serializers.ListSerializer) and name in properties:
                if field.max_length is not None:
                    properties[name]["maxItems"] = field.max_length
                if field.min_length is not None:
                    properties[name]["minItems"] = field.min_length
                elif not field.allow_empty:
                    properties[name]["minItems"] = 1
        properties.update(_extra_properties(self.target))
        if isinstance(self.target, api.RunIdsOrFilterSerializer):
            properties["filter"] = {
                "type": "object",
                "properties": {
                    "job": {"type": "string", "description": "Only runs of this job."},
                    "queue": {"type": "string", "description": "Only runs of this queue."},
                    "since": {
                        "type": "string",
                        "format": "date-time",
                        "description": "Only runs created at or after this time.",
                    },
                },
                "additionalProperties": False,
                "description": "Select the dead runs by filter instead of by id.",
            }
            schema["oneOf"] = [{"required": ["runIds"]}, {"required": ["filter"]}]
        own_doc = type(self.target).__dict__.get("__doc__")
        description = REQUEST_DESCRIPTIONS.get(type(self.target), own_doc)
        if getattr(self.target, "partial", False):
            description = "The fields to change; the others keep their values."
            for prop in properties.values():
                prop.pop("default", None)
        schema["description"] = " ".join(
            part for part in (description, "Unknown fields are refused (400).") if part
        )
        schema["additionalProperties"] = False
        return schema


class JSONValueFieldExtension(OpenApiSerializerFieldExtension):
    """A JSON payload or result (over the payload cap it is a 413)."""

    target_class = api.JSONValueField

    def map_serializer_field(self, auto_schema, direction):
        if self.target.allow_null:
            return {"description": "Any JSON value."}
        return dict(ANY_JSON_NOT_NULL)


def _schedule_schema() -> dict[str, Any]:
    return {
        "description": (
            "One of: cron (`cron` with optional `timeZone`, `jitterSeconds`, "
            "`missedRunPolicy`), one-off (`runAt`), delayed (`delaySeconds`), or `{}` for "
            "runs only triggered through the API or the dashboard."
        ),
        "oneOf": [
            {
                "type": "object",
                "title": "Cron",
                "properties": {
                    "cron": {
                        "type": "string",
                        "minLength": 1,
                        "description": "5 fields (minute hour day-of-month month day-of-week) "
                        "or a macro such as `@daily`.",
                        "example": "0 2 * * *",
                    },
                    "timeZone": {
                        "type": "string",
                        "default": "UTC",
                        "description": "An IANA time zone name.",
                        "example": "Europe/Berlin",
                    },
                    "jitterSeconds": {
                        "type": "integer",
                        "minimum": 0,
                        "default": 60,
                        "description": "Spread the start by a stable per-job offset below this "
                        "many seconds; 0 turns it off. At most the shortest gap between fire "
                        "times.",
                    },
                    "missedRunPolicy": {
                        "type": "string",
                        "enum": list(sched.MISSED_RUN_POLICIES),
                        "default": sched.DEFAULT_MISSED_RUN_POLICY,
                        "description": "What to do with fire times missed during an outage.",
                    },
                },
                "required": ["cron"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "title": "OneOff",
                "properties": {
                    "runAt": {
                        "type": "string",
                        "format": "date-time",
                        "description": "One run at this time (with an offset or Z).",
                    }
                },
                "required": ["runAt"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "title": "Delayed",
                "properties": {
                    "delaySeconds": {
                        "type": "integer",
                        "minimum": 0,
                        "maximum": sched.MAX_DELAY_SECONDS,
                        "description": "One run, this long after the definition's creation.",
                    }
                },
                "required": ["delaySeconds"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "title": "None",
                "properties": {},
                "maxProperties": 0,
                "additionalProperties": False,
            },
        ],
    }


class ScheduleFieldExtension(OpenApiSerializerFieldExtension):
    target_class = api.ScheduleField

    def get_name(self):
        return "Schedule"

    def map_serializer_field(self, auto_schema, direction):
        return _schedule_schema()


# --- operations: why not running, queues ----------------------------------------------------


class ReasonSerializer(serializers.Serializer):
    code = serializers.ChoiceField(
        choices=[
            "running",
            "finished",
            "backoff",
            "scheduled",
            "definition_paused",
            "queue_paused",
            "concurrency_limit",
            "no_worker",
            "behind_higher_priority",
            "queued",
            "no_schedule",
            "schedule_done",
            "next_fire",
        ]
    )
    message = serializers.CharField()
    detail = serializers.DictField(required=False)


class WhyAnswerSerializer(serializers.Serializer):
    subject = serializers.CharField(help_text="The run id or the job name.")
    state = serializers.CharField(required=False)
    reasons = ReasonSerializer(many=True, help_text="Empty when nothing holds it.")


class QueueSerializer(serializers.Serializer):
    name = serializers.CharField()
    paused = serializers.BooleanField()
    depth = serializers.DictField(
        child=serializers.IntegerField(), help_text="Ready runs by priority."
    )
    oldestReadyAt = serializers.DateTimeField(allow_null=True)
    lastLeasedAt = serializers.DateTimeField(allow_null=True)
    lastWorkerId = serializers.CharField(allow_blank=True)


class QueueListSerializer(serializers.Serializer):
    results = QueueSerializer(many=True)


QUEUE_NAME = OpenApiParameter(
    "name",
    {"type": "string", "minLength": 1, "maxLength": 100},
    OpenApiParameter.PATH,
    required=True,
    description="The queue's name.",
)


class BackfillRequestSerializer(serializers.Serializer):
    # "from" is a Python keyword: declared through the fields mapping below.
    to = serializers.DateTimeField(
        help_text="End of the range (inclusive), ISO 8601 with an offset."
    )
    confirm = serializers.BooleanField(
        default=False, help_text="false: preview only; true: create."
    )


BackfillRequestSerializer._declared_fields["from"] = serializers.DateTimeField(
    help_text="Start of the range (inclusive), ISO 8601 with an offset."
)


class BackfillAnswerSerializer(serializers.Serializer):
    count = serializers.IntegerField(help_text="Cron times in the range (up to the cap).")
    existing = serializers.IntegerField(help_text="Of those, times that already have a run.")
    new = serializers.IntegerField(help_text="Runs a confirmed backfill creates.")
    created = serializers.IntegerField(help_text="Runs created (0 for a preview).")
    capped = serializers.BooleanField()
    confirmed = serializers.BooleanField()
    sample = serializers.ListField(
        child=serializers.CharField(), help_text="The first local times."
    )


class SyncRequestSerializer(serializers.Serializer):
    jobs = api.DefinitionSerializer(many=True)
    prune = serializers.BooleanField(
        default=False, help_text="Delete the team's definitions not listed."
    )
    dryRun = serializers.BooleanField(default=False, help_text="Answer the diff; change nothing.")


class SyncChangeSerializer(serializers.Serializer):
    action = serializers.ChoiceField(choices=["create", "update", "delete"])
    name = serializers.CharField()
    fields = serializers.DictField(
        required=False, help_text="For updates: field → {before, after}."
    )


class SyncAnswerSerializer(serializers.Serializer):
    changes = SyncChangeSerializer(many=True)
    summary = serializers.DictField(child=serializers.IntegerField())
    applied = serializers.BooleanField()


class AlertSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=["late", "missed"])
    job = serializers.CharField()
    runId = serializers.CharField(allow_null=True)
    dueAt = serializers.DateTimeField()
    lateBySeconds = serializers.FloatField(allow_null=True)
    sloSeconds = serializers.IntegerField()
    owner = serializers.CharField(allow_blank=True)
    runbookUrl = serializers.CharField(allow_blank=True)
    message = serializers.CharField()


class AlertListSerializer(serializers.Serializer):
    results = AlertSerializer(many=True)
