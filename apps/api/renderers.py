"""JSON answers with orjson: an answer of 100 leases took 170 µs to encode with the standard
library, 13 µs with orjson (bench/README.md, "Where the time goes")."""

from __future__ import annotations

import json
from typing import Any

import orjson
from rest_framework import renderers
from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.utils.encoders import JSONEncoder

# Datetimes, decimals and lazy strings are rendered as DRF renders them (its encoder's
# `default`); dict keys that are not strings become strings, as the standard library does.
OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_NON_STR_KEYS
_fallback = JSONEncoder().default


class FastJSONRenderer(renderers.JSONRenderer):
    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: dict | None = None,
    ) -> bytes:
        if data is None:
            return b""
        if isinstance(data, Rendered):
            return data
        if self.get_indent(accepted_media_type, renderer_context or {}):
            # Asked for indented output (`Accept: application/json; indent=2`): a person reading.
            return super().render(data, accepted_media_type, renderer_context)
        return render_json(data)


class Rendered(bytes):
    """An answer already rendered to JSON (the lease answer, built inside the claim's
    transaction so that a failure to render rolls the claim back)."""


def render_json(data: Any) -> bytes:
    if isinstance(data, Rendered):
        return data
    try:
        return orjson.dumps(data, default=_fallback, option=OPTIONS)
    except TypeError:
        # An integer past 64 bits, stored before bodies holding one were refused (the API and
        # the dashboard refuse them now): the standard library writes it.
        return json.dumps(data, cls=JSONEncoder, separators=(",", ":")).encode()


class Negotiation(DefaultContentNegotiation):
    """DRF's negotiation, where a `?format=` this view cannot render is a 406 naming the
    formats it can (DRF answers a bare 404, as if the path were wrong)."""

    def filter_renderers(self, renderers: list, format: str) -> list:
        kept = [renderer for renderer in renderers if renderer.format == format]
        if not kept:
            offered = ", ".join(sorted({renderer.format for renderer in renderers}))
            raise NotAcceptable(f"format {format!r} is not offered here: {offered}.")
        return kept
