"""Small typed readers for the environment, so settings read one way."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from django.core.exceptions import ImproperlyConfigured

T = TypeVar("T", int, float)


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_int(name: str, default: int, *, low: int | None = None, high: int | None = None) -> int:
    """An integer setting, refused at start-up (ImproperlyConfigured, naming it) when it is not
    one or is outside [low, high]: a bad value found later was a 500 on every call or a busy
    loop."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}.") from None
    return _within(name, value, low, high)


def env_float(
    name: str, default: float, *, low: float | None = None, high: float | None = None
) -> float:
    """A number setting (seconds, say), as env_int; NaN and infinity are refused too."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}.") from None
    if not math.isfinite(value):
        raise ImproperlyConfigured(f"{name} must be a finite number, got {raw!r}.")
    return _within(name, value, low, high)


def _within(name: str, value: T, low: T | None, high: T | None) -> T:
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"from {low} to {high}"
        raise ImproperlyConfigured(f"{name} must be {bounds}, got {value}.")
    return value


TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    word = raw.strip().lower()
    if word not in TRUE | FALSE:
        raise ImproperlyConfigured(f"{name} must be true or false (1/0, yes/no, on/off).")
    return word in TRUE


def env_choice(name: str, default: str, choices: Iterable[str]) -> str:
    """One of `choices`, in any case (`info` for `INFO`), written as the choice is."""
    value = os.environ.get(name) or default
    by_case = {choice.lower(): choice for choice in choices}
    if value.lower() not in by_case:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}; got {value!r}.")
    return by_case[value.lower()]


# DRF's rates: a count, a slash, a period named by its first letter ("20/s", "1000/min").
# At least 1 a period: a rate of 0 refused every call (429) and every batch (400).
RATE = re.compile(r"0*[1-9]\d*/[smhd]\w*")


def env_rate(name: str, default: str) -> str:
    """A rate limit ("20/s"); empty for none."""
    value = os.environ.get(name, default).strip()
    if value and not RATE.fullmatch(value):
        raise ImproperlyConfigured(
            f"{name} must be a rate of at least 1 such as 20/s or 1000/min, or empty."
        )
    return value


def env_folder(name: str, default: str, *, create: bool) -> Path:
    """A folder this process writes to, made first when `create` says so (else it must exist),
    refused at start-up (ImproperlyConfigured, naming it) when it cannot be used: found by
    whatever wrote there first (prometheus_client at its import, the static files' folder), it
    was a traceback that named no setting."""
    folder = Path(os.environ.get(name) or default)
    must = f"{name} must be {'a' if create else 'an existing'} folder this process can write to"
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if not folder.exists():  # else a file there, said below
                raise ImproperlyConfigured(
                    f"{must}; {folder} cannot be made: {exc.strerror}."
                ) from None
    if not folder.exists():
        raise ImproperlyConfigured(f"{must}; {folder} does not exist.")
    if not folder.is_dir():
        raise ImproperlyConfigured(f"{must}; {folder} is not a folder.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ImproperlyConfigured(f"{must}; {folder} is not writable.")
    return folder


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]
