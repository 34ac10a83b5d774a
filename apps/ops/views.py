from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST

from apps.ops.metrics import render


def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text format. Expose it to the monitoring network only."""
    return HttpResponse(render(), content_type=CONTENT_TYPE_LATEST)
