"""Response headers every dashboard page carries."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

# The API's own docs page (Swagger UI) and Django's admin bring their own scripts.
EXEMPT_PREFIXES = ("/api/", "/admin/")


class ContentSecurityPolicyMiddleware:
    """Send `settings.DASHBOARD_CSP` with every HTML page: no inline script, no other origin."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if not request.path.startswith(EXEMPT_PREFIXES):
            response.headers.setdefault("Content-Security-Policy", settings.DASHBOARD_CSP)
            response.headers.setdefault("Referrer-Policy", "same-origin")
            response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response
