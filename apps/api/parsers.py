from __future__ import annotations

import json

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

from apps.api.errors import PayloadTooLarge


class JSONObjectParser(parsers.JSONParser):
    """JSON bodies only, refused before reading when larger than the payload cap allows."""

    def parse(self, stream, media_type=None, parser_context=None):
        request = (parser_context or {}).get("request")
        length = request.META.get("CONTENT_LENGTH") if request is not None else None
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if length and length.isdigit() and int(length) > limit:
            raise PayloadTooLarge(f"The request body is {int(length)} bytes; the limit is {limit}.")
        try:
            return super().parse(stream, media_type, parser_context)
        except ParseError as exc:
            raise ParseError(f"The body is not valid JSON: {exc.detail}") from exc


def payload_size(value) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())
