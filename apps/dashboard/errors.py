"""Error pages: JSON problem details under /api/, HTML everywhere else."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views import defaults

from apps.api import errors as api_errors


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith("/api/"):
        return api_errors.bad_request(request, exception)
    return defaults.bad_request(request, exception)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith("/api/"):
        return api_errors.not_found(request, exception)
    return render(request, "404.html", status=404)


def server_error(request: HttpRequest) -> HttpResponse:
    if request.path.startswith("/api/"):
        return api_errors.server_error(request)
    # No context processors or database here: the error may be the database itself.
    from django.template import loader

    return HttpResponse(loader.get_template("500.html").render(), status=500)
