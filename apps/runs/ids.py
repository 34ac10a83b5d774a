"""Public run ids: `run_` and the primary key in Crockford base 32 (short, unambiguous, URL-safe)."""

from __future__ import annotations

ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_INDEX = {ch: i for i, ch in enumerate(ALPHABET)}
PREFIX = "run_"


# Two base-32 digits per lookup: ids are formatted once per run on every lease and result.
_PAIRS = [a + b for a in ALPHABET for b in ALPHABET]


def public_run_id(pk: int) -> str:
    if pk is None:
        return ""
    if pk < 32:
        return PREFIX + ALPHABET[pk]
    pairs = []
    value = pk
    while value:
        pairs.append(_PAIRS[value & 1023])
        value >>= 10
    return PREFIX + "".join(reversed(pairs)).lstrip("0")


def parse_run_id(run_id: str) -> int | None:
    """Return the primary key of a public id, or None when it is not one of ours."""
    if not isinstance(run_id, str) or not run_id.startswith(PREFIX) or len(run_id) > 20:
        return None
    value = 0
    for ch in run_id[len(PREFIX) :].upper():
        if ch not in _INDEX:
            return None
        value = value * 32 + _INDEX[ch]
    return value if run_id[len(PREFIX) :] else None
