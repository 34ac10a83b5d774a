from __future__ import annotations

import json
from typing import Any

import orjson
from rest_framework import parsers
from rest_framework.exceptions import ParseError, ValidationError

from apps.runs import limits


class JSONObjectParser(parsers.JSONParser):
    """JSON bodies, with the parser's reason in the problem detail."""

    def parse(self, stream, media_type=None, parser_context=None):
        return parse_json(stream.read())


def parse_json(raw: bytes) -> Any:
    limit = limits.json_max_depth()
    try:
        # orjson, like DRF's strict parser, refuses NaN and Infinity, and lone surrogates.
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg == "depth limit exceeded":  # orjson's own limit, far past ours
            raise ValidationError(
                {"body": [f"Nested deeper than {limit} levels of objects and lists."]}
            ) from exc
        raise ParseError(f"The body is not valid JSON: {exc}") from exc
    # orjson reads an integer past 64 bits as a float: refused rather than rounded.
    inexact = limits.inexact_integer_problem(raw)
    if inexact is not None:
        raise ValidationError({"body": [inexact]})
    # Whatever is accepted must render back: nested past the limit, a value was once stored and
    # then answered 500 on every list showing it. Counting brackets (6 µs for 100 results)
    # spares most bodies the walk.
    if raw.count(b"{") + raw.count(b"[") > limit:
        where = limits.json_too_deep(data, limit)
        if where is not None:
            raise ValidationError(
                {where: [f"Nested deeper than {limit} levels of objects and lists."]}
            )
    # PostgreSQL's text and jsonb cannot hold U+0000, which JSON writes as \u0000: refuse it
    # here (400) rather than in the database (500). The byte search keeps the common case
    # cheap; the walk tells a real NUL from an escaped backslash followed by "u0000".
    if b"\\u0000" in raw:
        pending = [data]
        while pending:
            value = pending.pop()
            if isinstance(value, dict):
                pending.extend(value.keys())
                pending.extend(value.values())
            elif isinstance(value, list):
                pending.extend(value)
            elif isinstance(value, str) and "\x00" in value:
                raise ValidationError(
                    {"body": ["Strings cannot contain the NUL character (\\u0000)."]}
                )
    return data


def payload_size(value) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())
