"""Turn a DATABASE_URL into Django's DATABASES entry."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse


def config_from_url(url: str, *, application_name: str) -> dict[str, Any]:
    parsed = urlparse(url)
    if parsed.scheme not in {"postgres", "postgresql"}:
        raise ValueError(
            f"DATABASE_URL must be a postgresql:// URL (SQLite is not supported): {url!r}"
        )
    query = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    host = query.pop("host", None) or parsed.hostname or ""
    options = {"application_name": application_name}
    options.update(query)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parsed.path.lstrip("/")) or "postgres",
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": host,
        "PORT": str(parsed.port or ""),
        "CONN_MAX_AGE": 60,
        "CONN_HEALTH_CHECKS": True,
        "OPTIONS": options,
        # Parallel test sessions on one server each name their own test database.
        "TEST": {"NAME": os.environ.get("TEST_DATABASE_NAME") or None},
    }
