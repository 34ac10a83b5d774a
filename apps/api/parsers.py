from __future__ import annotations

import json

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONObjectParser(parsers.JSONParser):
    """JSON bodies, with the parser's reason in the problem detail."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except ParseError as exc:
            raise ParseError(f"The body is not valid JSON: {exc.detail}") from exc


def payload_size(value) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())
