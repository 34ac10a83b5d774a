"""Public run ids: `run_` and the primary key in Crockford base 32 (short, unambiguous, URL-safe)."""

from __future__ import annotations

import re

ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
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


# Crockford's digits, either case, spelled as the digits int(..., 32) reads. int() alone would
# also take signs, underscores and spaces, so the regex says what a digit is.
_DIGITS = re.compile("[0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]+")
_AS_INT_DIGITS = str.maketrans(ALPHABET + ALPHABET.lower(), "0123456789ABCDEFGHIJKLMNOPQRSTUV" * 2)


# A primary key is a PostgreSQL bigint.
MAX_PK = 2**63 - 1


def parse_run_id(run_id: str) -> int | None:
    """Return the primary key of a public id, or None when it is not one of ours: digits as
    public_run_id writes them (a leading zero would give one run a second id, which a batch's
    each-run-once check would not see), in either case, of a bigint."""
    if not isinstance(run_id, str) or not run_id.startswith(PREFIX) or len(run_id) > 20:
        return None
    digits = run_id[len(PREFIX) :]
    if not _DIGITS.fullmatch(digits) or (digits[0] == "0" and len(digits) > 1):
        return None
    pk = int(digits.translate(_AS_INT_DIGITS), 32)
    return pk if pk <= MAX_PK else None
