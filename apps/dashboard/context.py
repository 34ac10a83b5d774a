"""Template context every dashboard page gets."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest

from apps.runs import shards


def unavailable_shards(request: HttpRequest) -> dict[str, Any]:
    """The shards this page could not read (its banner); lazy, so that reads made while the page
    renders count too."""
    return {"unavailable_shards": shards.noted}


def request_limits(request: HttpRequest) -> dict[str, Any]:
    """The largest body the server reads: the page's script stops a form larger than that
    before it is sent (the server would refuse it unread, and the input be lost). And the
    sign-in page's address: a form sent after the session ended lands there, and the script
    puts back what was typed once the reader is back on the form."""
    return {"max_body": settings.DATA_UPLOAD_MAX_MEMORY_SIZE, "sign_in_url": settings.LOGIN_URL}
