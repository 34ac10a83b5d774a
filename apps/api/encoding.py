"""Request bodies are taken as sent: one under a Content-Encoding (gzip, br, …), or declaring a
character set other than UTF-8, is refused."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from apps.api.errors import json_problem


class RefuseEncodedBodies:
    """A 415 problem for an API request whose body declares a Content-Encoding other than
    `identity`: read as it is, a compressed body was a misleading "not valid UTF-8", and a plain
    one sent under `gzip` was taken though its header said otherwise. The same for a body whose
    Content-Type names a charset other than UTF-8 (or its subset, US-ASCII)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        encoding = request.META.get("HTTP_CONTENT_ENCODING", "").strip().lower()
        if encoding and encoding != "identity" and request.path.startswith("/api/"):
            response = json_problem(
                415, f"Content-Encoding {encoding[:40]!r} is not accepted: send the body as it is."
            )
            response["Accept-Encoding"] = "identity"
            return response
        if "charset" in request.META.get("CONTENT_TYPE", "") and request.path.startswith("/api/"):
            charset = request.content_params.get("charset", "").strip().lower()
            # JSON between systems is UTF-8 (RFC 8259, section 8.1); a body declared UTF-16 was
            # read as UTF-8 all the same, and one in Latin-1 kept its bytes misread.
            if charset not in UTF_8_NAMES:
                return json_problem(
                    415, f"charset {charset[:40]!r} is not accepted: send the body as UTF-8."
                )
        return self.get_response(request)


UTF_8_NAMES = frozenset({"utf-8", "utf8", "us-ascii"})
