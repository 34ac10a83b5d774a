"""The limits every input meets, wherever it enters (API, dashboard, `apply` files, SDK calls).

One module, so a name, a JSON value or a run time accepted in one place is accepted in every
other, and anything accepted can be stored and rendered back: a value nested deeper than the
JSON encoder can write (orjson stops at 254 levels) was once stored, then answered 500 on every
list that showed it.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings

# Job names: lowercase dotted words ("billing.export-invoices").
JOB_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)*$")
JOB_NAME_MAX = 200
JOB_NAME_RULE = (
    "Use lowercase dotted words of letters, digits, '-' and '_', e.g. 'billing.export-invoices'."
)
# Queue names: one word of letters, digits and . : - _ (they appear in URLs and metric labels).
QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
QUEUE_NAME_MAX = 100
QUEUE_NAME_RULE = "Use letters, digits, '.', ':', '-' and '_', starting with a letter or digit."
# Worker ids: printable text without control characters ("host-1/1234", "pod:abc@eu-1").
WORKER_ID_RE = re.compile(r"^[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?$")
WORKER_ID_MAX = 200
WORKER_ID_RULE = "Printable ASCII without leading or trailing spaces, up to 200 characters."

# A list's page (`?limit=`): its default and most. Lists page by cursor and never count.
PAGE_DEFAULT = 50
PAGE_MAX = 500

# A worker's stack trace (`error.stack`): past this many characters its end is kept, where the
# error is, under a line saying how much of its start was cut; the report is never refused for
# it (the whole body's size limit already bounds it). The SDK cuts the same way before sending.
STACK_MAX_CHARS = 64 * 1024


def cut_stack(stack: str, limit: int = STACK_MAX_CHARS) -> str:
    """`stack` itself, or its last characters under a marker line, `limit` characters in all."""
    if len(stack) <= limit:
        return stack
    marker = ""
    while True:  # the count's digits are part of the length it counts: until it holds still
        kept = limit - len(marker)
        again = f"[{len(stack) - kept} characters cut]\n"
        if again == marker:
            return marker + stack[len(stack) - kept :]
        marker = again


def _name_problem(value: object, pattern: re.Pattern, longest: int, rule: str) -> str | None:
    if not isinstance(value, str):
        return "Not a valid string."
    if not value:
        return "This field may not be blank."
    if len(value) > longest:
        return f"Ensure this field has no more than {longest} characters."
    # fullmatch: `$` also matches before a final newline ("a.job\n" would pass `match`).
    return None if pattern.fullmatch(value) else rule


def job_name_problem(value: object) -> str | None:
    """Why `value` is not a job name, or None when it is one."""
    return _name_problem(value, JOB_NAME_RE, JOB_NAME_MAX, JOB_NAME_RULE)


def queue_name_problem(value: object) -> str | None:
    """Why `value` is not a queue name, or None when it is one."""
    return _name_problem(value, QUEUE_NAME_RE, QUEUE_NAME_MAX, QUEUE_NAME_RULE)


def worker_id_problem(value: object) -> str | None:
    """Why `value` is not a worker id, or None when it is one."""
    return _name_problem(value, WORKER_ID_RE, WORKER_ID_MAX, WORKER_ID_RULE)


# --- JSON ------------------------------------------------------------------------------------


def json_max_depth() -> int:
    return settings.SCHEDULER_JSON_MAX_DEPTH


def json_too_deep(value: Any, limit: int | None = None) -> str | None:
    """Where `value` nests objects and lists deeper than `limit` levels, or None if it does not.

    The answer names the field ("payload"; in a batch, "results[3].result"). Recursive, with
    the recursion bounded by `limit`, and the path found only after a failure: 40 µs
    for a batch of 100 results, a fifth of a generic iterative walk, so every body affords it."""
    keys = too_deep_at(value, limit)
    return None if keys is None else field_path(keys)


def too_deep_at(value: Any, limit: int | None = None) -> list[str | int] | None:
    """The keys (outermost first) down to where `value` nests deeper than `limit` levels, or
    None if it does not."""
    limit = json_max_depth() if limit is None else limit
    if type(value) is not dict and type(value) is not list:
        return None
    if _fits(value, limit):
        return None
    return list(reversed(_deeper(value, limit) or []))


# The fields whose insides are the client's own JSON: a path stops at them (what is under them
# names nothing the client's schema has), and at this many keys (a path down a deep nest).
FREE_FORM_FIELDS = frozenset({"payload", "result"})
FIELD_PATH_KEYS = 4


def field_path(keys: list[str | int]) -> str:
    """The field a client names for the value at `keys` (outermost first): "payload",
    "rateLimit.periodSeconds"; in a batch, "results[3].result"; "body" for the body itself."""
    shown: list[str | int] = []
    for key in keys:
        if shown and isinstance(key, str) and not (key.isascii() and key.isidentifier()):
            break  # a key no schema has (a NUL in it, say): the path stops at its object
        shown.append(key)
        if key in FREE_FORM_FIELDS or len(shown) == FIELD_PATH_KEYS:
            break
    path = ""
    for key in shown:
        if isinstance(key, int):
            path = f"{path or 'body'}[{key}]"
        else:
            path = f"{path}.{key}" if path else str(key)
    return path or "body"


def _fits(value: dict | list, left: int) -> bool:
    if left == 0:
        return False
    for child in value.values() if type(value) is dict else value:
        kind = type(child)
        if (kind is dict or kind is list) and not _fits(child, left - 1):
            return False
    return True


def _deeper(value: dict | list, left: int) -> list | None:
    """None when `value` fits in `left` levels, else the keys down to the excess, innermost first."""
    if left == 0:
        return []
    items = value.items() if type(value) is dict else enumerate(value)
    for key, child in items:
        kind = type(child)
        if kind is dict or kind is list:
            below = _deeper(child, left - 1)
            if below is not None:
                below.append(key)
                return below
    return None


def json_depth_problem(value: Any) -> tuple[str, str] | None:
    """(field, reason) when `value` cannot be accepted as JSON here, or None."""
    limit = json_max_depth()
    where = json_too_deep(value, limit)
    if where is None:
        return None
    return where, f"Nested deeper than {limit} levels of objects and lists."


# The integers orjson reads exactly and writes back; past them it reads a float (2**70 would be
# stored, and leased, as 1180591620717411300000) and refuses to write one.
EXACT_INTEGERS = range(-(2**63), 2**64)
# Each digit byte to "1", every other byte to "0": a run of 19 digits is then a `find`. On a body
# of 100 results 7-15 µs; a regular expression (\d{19,}) took 90-156.
_DIGIT_BYTES = bytes(0x31 if 0x30 <= byte <= 0x39 else 0x30 for byte in range(256))
_NINETEEN_DIGITS = b"1" * 19


class LongInteger(str):
    """An integer literal too long to be one of 64 bits, kept as its text: Python refuses to
    convert one of more than 4 300 digits, and the whole batch was refused with its words."""


def read_integer(literal: str) -> int | float | LongInteger:
    """`json.loads`'s `parse_int`: a JSON integer has no leading zeros, so one of more than 21
    characters is past 64 bits, whatever it is. One past 64 bits that is a float's value
    written out is that float (as orjson reads it); others stay what they are, to be refused."""
    if len(literal) <= 21 and (value := int(literal)) in EXACT_INTEGERS:
        return value
    if float_written_out(literal):
        return float(literal)
    return value if len(literal) <= 21 else LongInteger(literal)


def inexact_integers(text: str | bytes) -> list[tuple[list[str | int], str]]:
    """Where a valid JSON text holds an integer past 64 bits (nothing here carries one exactly
    everywhere it goes: JSON answers, jsonb, the workers' languages), each with why it is
    refused: (keys, outermost first; reason). Only a text with a run of 19 digits (in a number
    or a string) is read again to find out."""
    raw = text.encode() if isinstance(text, str) else text
    if raw.translate(_DIGIT_BYTES).find(_NINETEEN_DIGITS) < 0:
        return []
    try:
        exact = json.loads(raw, parse_int=read_integer)
    except RecursionError:
        # Nested some thousand levels deep (orjson reads up to 1 024): far past the depth
        # limit, which refuses it. A 500 before.
        return []
    return [
        (keys, inexact_reason(value))
        for keys, value in walk(exact)
        if (type(value) is int and value not in EXACT_INTEGERS) or type(value) is LongInteger
    ]


def float_written_out(literal: str) -> bool:
    """Whether an integer literal is a float's value written out in full, as PostgreSQL writes
    back a payload's 1e25 (10000000000000000000000000): read as that float and written
    shortest, it comes back whole, so a job read back can be sent again as it was read."""
    as_float = float(literal)
    return math.isfinite(as_float) and Decimal(repr(as_float)) == Decimal(literal)


def inexact_reason(value: int) -> str:
    literal = str(value)
    shown = literal if len(literal) <= 30 else literal[:30] + "…"
    return f"The integer {shown} is outside 64 bits and would lose digits: send it as a string."


def nul_strings(value: Any) -> list[list[str | int]]:
    """Where `value` holds a string (a value or an object's key) with U+0000, which
    PostgreSQL's text and jsonb cannot hold."""
    return [
        keys for keys, leaf in walk(value, keys_too=True) if type(leaf) is str and "\x00" in leaf
    ]


def walk(value: Any, *, keys_too: bool = False) -> list[tuple[list[str | int], Any]]:
    """Every scalar of a JSON value with its keys (outermost first); with `keys_too`, objects'
    keys as well (at their own key's place). Iterative: the depth is not bounded yet."""
    found: list[tuple[list[str | int], Any]] = []
    pending: list[tuple[list[str | int], Any]] = [([], value)]
    while pending:
        keys, node = pending.pop()
        if type(node) is dict:
            for key, child in node.items():
                if keys_too:
                    found.append(([*keys, key], key))
                pending.append(([*keys, key], child))
        elif type(node) is list:
            pending.extend(([*keys, index], child) for index, child in enumerate(node))
        else:
            found.append((keys, node))
    return found


# --- run times -------------------------------------------------------------------------------


def run_time_problem(value: datetime, now: datetime) -> str | None:
    """Why `value` cannot be a run's time, or None: no more than the stated window in the past
    (backfill is the tool for the past) and not past year 9999 once delayed or jittered."""
    window = timedelta(seconds=settings.SCHEDULER_RUN_AT_PAST_SECONDS)
    if value < now - window:
        return (
            f"More than {settings.SCHEDULER_RUN_AT_PAST_SECONDS} seconds in the past; "
            "use a backfill for past times."
        )
    if value > LATEST_RUN_TIME:
        return "Later than 9999-01-01T00:00:00Z."
    return None


# Leaves a year of room before datetime's end for delays, jitter and retry backoff.
LATEST_RUN_TIME = datetime(9999, 1, 1, tzinfo=UTC)
