"""An error's fingerprint: which failures are "the same error" for triage.

Two errors are the same when their type is and their messages are once the parts that vary from
run to run are written as placeholders: UUIDs, our own run ids, hex ids (`0x7f3a…`, a commit or
an object id), quoted strings and numbers. `KeyError: 'user 123'` and `KeyError: 'user 456'` are
one group, `KeyError: '<str>'`. The fingerprint is the first 8 bytes of the SHA-256 of the type
and the normalised message, as a signed 64-bit integer: the FAIL and REAP statements store it
on the run (`runs_run.error_fingerprint`, apps/runs/store.py) and the failures' grouping reads it
from the partial index run_failed_by_fingerprint. Pages and URLs write it as 16 hex digits.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

# Only the head of a message is compared: a long message's tail (a dump, a response body) would
# otherwise split a group in as many as there are runs, and the head says what went wrong.
MESSAGE_CHARS = 1000

# The reaper's errors name the worker or the attempt in their message; the group is the reason.
REAPER_MESSAGES = {
    "lease_expired": "lease of worker <worker> expired without a heartbeat",
    "timed_out": "attempt <n> ran past timeoutSeconds (<n> s)",
}

# Applied in this order: a quoted string is replaced whole, whatever it holds, and a UUID or a
# hex id before the number rule could take it apart. Each pattern starts with a literal where
# it can (a lookbehind after it, for a word's start), which lets the engine skip ahead to that
# character: a 1 000-character message takes about 50 µs, where one pattern of alternatives
# and leading lookbehinds took 300 µs (measured here), on the fail path of every failure.
_UUID_HINT = re.compile(r"-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-")
_UUID = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
_RULES: list[tuple[re.Pattern[str], str]] = [
    # A quote that starts a word (not the apostrophe of "can't") to the next on its line.
    (re.compile(r"'(?<![A-Za-z0-9_]')[^'\n]*'"), "'<str>'"),
    (re.compile(r'"[^"\n]*"'), '"<str>"'),
    (re.compile(r"`[^`\n]*`"), "`<str>`"),
    (re.compile(r"run_(?<![A-Za-z0-9_]run_)[0-9A-Za-z]+"), "run_<id>"),
    (re.compile(r"0[xX](?<![A-Za-z0-9_]0[xX])[0-9a-fA-F]+\b"), "<hex>"),
]
_LONG_HEX = re.compile(r"[0-9a-fA-F]{8,}")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_WORD = re.compile(r"\w")


def _hex_id(match: re.Match[str]) -> str:
    """A run of 8 or more hex digits that is a whole word, with a digit and a letter: an id
    (a commit, an object id). A plain number is left to the number rule, and a word of the
    letters a-f alone ("deadbeef", "facade") stays."""
    text, start, end = match.string, match.start(), match.end()
    whole = (start == 0 or not _WORD.match(text, start - 1)) and (
        end == len(text) or not _WORD.match(text, end)
    )
    found = match.group()
    if whole and not found.isdigit() and any(c.isdigit() for c in found):
        return "<hex>"
    return found


def normalise(error_type: str, message: str) -> str:
    """The error as its group reads: `type: message` with the varying parts as placeholders."""
    error_type = (error_type or "").strip()
    if error_type in REAPER_MESSAGES:
        text = REAPER_MESSAGES[error_type]
    else:
        text = (message or "")[:MESSAGE_CHARS]
        if _UUID_HINT.search(text):
            text = _UUID.sub("<uuid>", text)
        for pattern, placeholder in _RULES:
            text = pattern.sub(placeholder, text)
        text = _NUMBER.sub("<n>", _LONG_HEX.sub(_hex_id, text))
        text = " ".join(text.split())
    if error_type and text:
        return f"{error_type}: {text}"
    return error_type or text


def of(error_type: str, message: str) -> int:
    """The fingerprint of an error (a signed 64-bit integer, as PostgreSQL's bigint holds it)."""
    digest = hashlib.sha256(normalise(error_type, message).encode("utf-8", "replace")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def of_error(error: Mapping[str, Any] | None) -> int:
    """The fingerprint of a run's `last_error` (`{"type", "message", …}`; None: no error)."""
    error = error or {}
    return of(str(error.get("type") or ""), str(error.get("message") or ""))


def to_hex(fingerprint: int) -> str:
    """16 hex digits, as pages and URLs write a fingerprint."""
    return format(fingerprint & 0xFFFF_FFFF_FFFF_FFFF, "016x")


_HEX = re.compile(r"[0-9a-f]{16}")


def from_hex(text: str) -> int | None:
    """The fingerprint written by `to_hex`, or None when `text` is not one."""
    if not isinstance(text, str) or not _HEX.fullmatch(text):
        return None
    value = int(text, 16)
    return value - (1 << 64) if value >= 1 << 63 else value
