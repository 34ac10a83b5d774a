"""What a name people read in lists may hold: the same rule for channel and token names."""

from __future__ import annotations

import unicodedata

# Unicode's Bidi_Control characters: the explicit direction embeddings, overrides and isolates
# (U+202A-E, U+2066-9) and the implicit marks (U+200E-F, U+061C), which move the neutral
# characters beside them.
TEXT_DIRECTION = frozenset(
    "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
)

UNREADABLE = "No control or text-direction characters."


def unreadable(value: str) -> bool:
    """Whether `value` holds a control character or an explicit text-direction one: a tab or
    an escape sequence in a page, or a right-to-left override that makes a name read as
    another in a list."""
    return any(unicodedata.category(ch) == "Cc" or ch in TEXT_DIRECTION for ch in value)
