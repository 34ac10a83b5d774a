"""What a name people read in lists may hold: the same rule for channel and token names."""

from __future__ import annotations

import unicodedata

# Unicode's explicit direction embeddings, overrides and isolates (U+202A-E, U+2066-9).
TEXT_DIRECTION = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")

UNREADABLE = "No control or text-direction characters."


def unreadable(value: str) -> bool:
    """Whether `value` holds a control character or an explicit text-direction one: a tab or
    an escape sequence in a page, or a right-to-left override that makes a name read as
    another in a list."""
    return any(unicodedata.category(ch) == "Cc" or ch in TEXT_DIRECTION for ch in value)
