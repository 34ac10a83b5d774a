"""Request bodies are taken as sent: one under a Content-Encoding (gzip, br, …) is refused."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from apps.api.errors import json_problem


class RefuseEncodedBodies:
    """A 415 problem for an API request whose body declares a Content-Encoding other than
    `identity`: read as it is, a compressed body was a misleading "not valid UTF-8", and a plain
    one sent under `gzip` was taken though its header said otherwise."""

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
        return self.get_response(request)
