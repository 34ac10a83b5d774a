"""Template context every dashboard page gets."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from apps.runs import shards


def unavailable_shards(request: HttpRequest) -> dict[str, Any]:
    """The shards this page could not read (its banner); lazy, so that reads made while the page
    renders count too."""
    return {"unavailable_shards": shards.noted}
