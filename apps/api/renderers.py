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


def _media_type(entry: str) -> str:
    return entry.split(";", 1)[0].strip().lower()


def _weighed_zero(entry: str) -> bool:
    """Whether an Accept entry (`application/json;q=0`) gives its media type a weight of 0."""
    for param in entry.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                return float(value.strip()) == 0
            except ValueError:
                return False
    return False


class Negotiation(DefaultContentNegotiation):
    """DRF's negotiation, where a `?format=` this view cannot render is a 406 naming the
    formats it can (DRF answers a bare 404, as if the path were wrong), and a media type the
    client weighs `q=0` is one it refuses (RFC 9110, 12.4.2), which DRF does not read."""

    def get_accept_list(self, request) -> list[str]:
        asked = super().get_accept_list(request)
        kept = [entry for entry in asked if not _weighed_zero(entry)]
        # All of them refused: nothing this view renders is acceptable (a 406).
        return kept if kept or not asked else ["none/none"]

    def select_renderer(self, request, renderers: list, format_suffix: str | None = None):
        # A type weighed 0 is refused however a wildcard beside it is weighed: RFC 9110 gives
        # the most specific range's weight, and `application/json;q=0, */*` was served JSON.
        refused = {
            _media_type(entry)
            for entry in super().get_accept_list(request)
            if _weighed_zero(entry) and "*" not in entry
        }
        if refused:
            renderers = [r for r in renderers if r.media_type.lower() not in refused]
            if not renderers:
                raise NotAcceptable("This resource is JSON only, and the Accept header refuses it.")
        return super().select_renderer(request, renderers, format_suffix)

    def filter_renderers(self, renderers: list, format: str) -> list:
        kept = [renderer for renderer in renderers if renderer.format == format]
        if not kept:
            offered = ", ".join(sorted({renderer.format for renderer in renderers}))
            raise NotAcceptable(f"format {format!r} is not offered here: {offered}.")
        return kept
