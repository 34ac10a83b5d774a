"""Every shape of the API, declared once: the same class validates, renders and documents.

- A request body is a pydantic model (`Body`): strict types (`"5"` is not 5, `true` is not 1),
  unknown fields refused, every bad field named in one answer. `parse(Model, data)` turns
  pydantic's errors into the API's 400 (`errors` keyed `retry.maxAttempts`, `leases[0].runId`).
- An answer is a `TypedDict`: the views build plain dicts through it (a type checker holds the
  keys), orjson renders them, and the OpenAPI schema is generated from the same class. A
  pydantic model per answer would cost four times as much to render: 240 µs against 58 µs for
  100 leases (measured here), on the workers' hot path.
- drf-spectacular reads both through the extensions at the end of this module; a test validates
  real answers against the schema (tests/fuzz).
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, TypeVar

import typing_extensions
from django.conf import settings
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.plumbing import ResolvedComponent
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from pydantic import ValidationError as PydanticError
from pydantic_core import PydanticCustomError
from rest_framework.exceptions import ValidationError

from apps.api.errors import PayloadTooLarge
from apps.api.parsers import RefusedItem
from apps.runs import limits, payloads

REF_TEMPLATE = "#/components/schemas/{model}"
# An instant as the API writes it (apps.runs.clock.format_utc): ISO 8601 in UTC with a Z, to
# the millisecond.
Instant = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
# Present on a list or count read across the shard databases when some could not be read.
UnavailableShards = Annotated[
    list[str],
    Field(
        description="Shards (e.g. `5-10`) whose database could not be read: what they hold is "
        "missing from this answer."
    ),
]
STRICT = ConfigDict(extra="forbid", strict=True)
ANSWER = ConfigDict(extra="forbid")


class Body(BaseModel):
    """A request body: strict, closed, and named in camelCase as the API spells it."""

    model_config = STRICT

    def problems(self) -> dict[str, list[str]]:
        """Rules across fields that name the item they fault (`leases[3].runId`); checked once
        the fields themselves are valid."""
        return {}


M = TypeVar("M", bound=BaseModel)


def body_size(request: Any) -> int:
    """The request body's declared length (under DRF's dispatch the body has been read as a
    stream); a body of unknown length counts as too large, so its values are measured."""
    size = request.META.get("CONTENT_LENGTH") or ""
    return int(size) if size.isdigit() else 2**62


def parse(model: type[M], data: Any, *, body_size: int = 0) -> M:
    """Validate `data` as `model`; a 400 naming every bad field otherwise.

    `body_size` is the request body's length: JSON values inside it are measured against the
    payload cap only when the body itself is over it (a value is never larger than its body)."""
    try:
        body = model.model_validate(data, context={"body_size": body_size})
    except PydanticError as exc:
        raise ValidationError(field_errors(exc)) from None
    faults = body.problems() if isinstance(body, Body) else {}
    if faults:
        raise ValidationError(faults)
    return body


def parse_each(
    model: type[M], items: list[Any], *, body_size: int = 0
) -> list[M | ValidationError | PayloadTooLarge]:
    """Each item parsed as by `parse`, or what `parse` would have raised for it: one bad item
    fails alone. The list is validated at once first, and item by item only when some item is
    bad (at once: 1.4 against 3.4 ms for 1 000 enqueue items, measured here)."""
    try:
        bodies: list[Any] = _list_of(model).validate_python(items, context={"body_size": body_size})
    except (PydanticError, PayloadTooLarge):
        bodies = items  # some item is bad: each is parsed on its own below
    parsed: list[M | ValidationError | PayloadTooLarge] = []
    for body in bodies:
        try:
            if isinstance(body, RefusedItem):  # a value no body may hold (parse_json)
                raise ValidationError(body.errors)
            if isinstance(body, model):
                faults = body.problems() if isinstance(body, Body) else {}
                if faults:
                    raise ValidationError(faults)
                parsed.append(body)
            else:
                parsed.append(parse(model, body, body_size=body_size))
        except (ValidationError, PayloadTooLarge) as exc:
            parsed.append(exc)
    return parsed


@functools.cache
def _list_of(model: type[M]) -> TypeAdapter[list[M]]:
    return TypeAdapter(list[model])


def field_errors(exc: PydanticError) -> dict[str, list[str]]:
    """pydantic's errors as {"retry.maxAttempts": ["…"]}; "body" for the body itself."""
    errors: dict[str, list[str]] = {}
    for error in exc.errors(include_url=False, include_context=False, include_input=False):
        errors.setdefault(location(error["loc"]), []).append(message(error))
    return errors


def location(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path = f"{path or 'body'}[{part}]"
        elif part:
            path = f"{path}.{part}" if path else str(part)
    return path or "body"


def message(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "Unknown field."
    if error["type"] == "missing":
        return "This field is required."
    if error["type"] == "model_type":  # pydantic names the model class: "…instance of Retry"
        return "Expected a JSON object."
    return error["msg"]


def problem(kind: str, text: str) -> PydanticCustomError:
    """A validation failure with the API's own wording (no "Value error," prefix)."""
    return PydanticCustomError(kind, text)


def name_check(problem_of):
    """An AfterValidator: the name rules of apps/runs/limits.py."""

    def check(value: str) -> str:
        reason = problem_of(value)
        if reason is not None:
            raise problem("name", reason)
        return value

    return check


def json_value(value: Any, info) -> Any:
    """A payload or result: within the payload cap (the depth was checked when parsed)."""
    if value is None:
        return value
    body_size = (info.context or {}).get("body_size", 0)
    cap = settings.SCHEDULER_PAYLOAD_MAX_BYTES
    if body_size > cap:
        # Counted as UTF-8: counted as ASCII JSON ("é" six bytes), a payload of a third of the
        # cap was refused once the body passed it.
        size = payloads.size(value)
        if size > cap:
            raise PayloadTooLarge(f"The {info.field_name} is {size} bytes; the limit is {cap}.")
    reason = limits.json_depth_problem(value)
    if reason is not None:
        raise problem("depth", reason[1])
    return value


def schema_of(shape: Any) -> tuple[dict, dict]:
    """The OpenAPI 3.0 schema of a model or TypedDict, and its sub-schemas ($defs)."""
    if isinstance(shape, type) and issubclass(shape, BaseModel):
        schema = shape.model_json_schema(ref_template=REF_TEMPLATE, mode="validation")
    else:
        schema = TypeAdapter(shape).json_schema(ref_template=REF_TEMPLATE, mode="serialization")
    defs = schema.pop("$defs", {})
    return openapi_30(schema), {name: openapi_30(sub) for name, sub in defs.items()}


def openapi_30(schema: Any) -> Any:
    """pydantic writes JSON Schema 2020-12; OpenAPI 3.0 spells `null` and `const` otherwise."""
    if isinstance(schema, list):
        return [openapi_30(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    # Titles pydantic derives from field names ("Runid") say nothing the name does not.
    # (A property named "title", as in problem details, has a schema, not a string, as value.)
    schema = {
        key: openapi_30(value)
        for key, value in schema.items()
        if not (key == "title" and isinstance(value, str))
    }
    if "const" in schema:
        schema["enum"] = [schema.pop("const")]
    options = schema.get("anyOf")
    if options and {"type": "null"} in options:
        rest = [option for option in options if option != {"type": "null"}]
        schema.pop("anyOf")
        if len(rest) == 1 and "$ref" not in rest[0]:
            schema = {**rest[0], **schema}
        else:
            schema["anyOf"] = rest
        schema["nullable"] = True
    return schema


class ShapeExtension(OpenApiSerializerExtension):
    """Request models and answer TypedDicts in drf-spectacular's schema, under their names."""

    target_class = "builtins.dict"  # TypedDicts are dicts; request models match below
    match_subclasses = True
    priority = 1  # before drf-spectacular's own pydantic extension, which writes 2020-12 schemas

    @classmethod
    def _matches(cls, target: Any) -> bool:
        return isinstance(target, type) and (
            issubclass(target, Body) or (issubclass(target, dict) and target is not dict)
        )

    def get_name(self, auto_schema, direction):
        return self.target.__name__

    def map_serializer(self, auto_schema, direction):
        schema, defs = schema_of(self.target)
        classes = nested_shapes(self.target)
        for name, sub in defs.items():
            # Registered under its class, as drf-spectacular registers a shape it meets itself:
            # a shape that is an answer of its own and part of another (a Queue, a Run) is then
            # one component reached both ways, not two of one name.
            shape = classes.get(name, name)
            auto_schema.registry.register_on_missing(
                ResolvedComponent(
                    name=name, type=ResolvedComponent.SCHEMA, object=shape, schema=sub
                )
            )
        return schema


def nested_shapes(shape: Any, found: dict[str, type] | None = None) -> dict[str, type]:
    """The models and TypedDicts a shape's fields hold, at any depth, by class name (the names
    pydantic gives their sub-schemas)."""
    found = {} if found is None else found
    if isinstance(shape, type) and issubclass(shape, BaseModel):
        hints = [field.annotation for field in shape.model_fields.values()]
    elif typing_extensions.is_typeddict(shape):
        hints = list(typing.get_type_hints(shape).values())
    else:
        hints = list(typing.get_args(shape))
    for hint in hints:
        if isinstance(hint, type) and (
            issubclass(hint, BaseModel) or typing_extensions.is_typeddict(hint)
        ):
            if hint.__name__ in found:
                continue
            found[hint.__name__] = hint
        nested_shapes(hint, found)
    return found
