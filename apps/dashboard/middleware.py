"""What every dashboard request passes through: the sign-in gate, the security headers, and
the shards whose database could not be read."""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlencode, urlsplit

from django.conf import settings
from django.contrib.auth import REDIRECT_FIELD_NAME
from django.contrib.auth.middleware import LoginRequiredMiddleware
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django_htmx.http import HttpResponseClientRedirect

from apps.runs import payloads, shards
from scheduler_site.database import (
    RETRY_AFTER_SECONDS,
    CommitRefused,
    failure_words,
    log_failure,
)

logger = logging.getLogger(__name__)

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


class SignInRequiredMiddleware(LoginRequiredMiddleware):
    """Fail closed: every page needs a signed-in user unless its view says otherwise.

    The views check too (`signed_in`, roles in `apps.teams.access`); this catches a view that
    forgot. The API's views are exempt (they authenticate bearer tokens), as are health and
    metrics. An HTMX request is sent to the sign-in page as a whole-page redirect.
    """

    def handle_no_permission(self, request: HttpRequest, view_func) -> HttpResponse:
        if getattr(request, "htmx", False):
            # Back to the page the action was sent from once signed in (its filter in the
            # query), not to the overview.
            current = urlsplit(request.headers.get("HX-Current-URL", ""))
            page = current.path + (f"?{current.query}" if current.query else "")
            login = settings.LOGIN_URL
            if page.startswith("/") and not page.startswith("//"):  # a path of this site
                login += "?" + urlencode({REDIRECT_FIELD_NAME: page})
            return HttpResponseClientRedirect(login)
        return super().handle_no_permission(request, view_func)


class UnavailableShardsMiddleware:
    """A page shows what it could read: the lists and counts that span shard databases leave a
    database that is down out and note its shards (`shards.noting`), which the page's banner
    names; a page about one object of such a shard (a run, a job) is a 503 that says which."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with shards.noting():
            return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if request.path.startswith("/api/"):
            return None
        page = self._unavailable(request, exception)
        if page is not None:
            page["Retry-After"] = str(RETRY_AFTER_SECONDS)  # as the API's 503 says
        return page

    @staticmethod
    def _unavailable(request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, shards.Unavailable):
            return render(request, "shard_unavailable.html", {"spans": exception.spans}, status=503)
        if isinstance(exception, payloads.Unavailable):
            # Editing a job whose payload is kept in storage: the form would write it back.
            logger.warning("%s", exception, exc_info=exception.__cause__)
            return render(request, "payload_unavailable.html", {"why": str(exception)}, status=503)
        if isinstance(exception, OperationalError | InterfaceError):
            # A lock wait or a statement past its timeout, a dropped connection, a commit the
            # database refused: the request's transaction was rolled back, and the page says so
            # rather than "server error".
            log_failure(exception, logger)
            context = {
                "words": failure_words(exception),
                "refused": isinstance(exception, CommitRefused),
            }
            return render(request, "database_failed.html", context, status=503)
        return None
