"""Error fingerprints: which failures are one group (apps/runs/fingerprints.py). No database."""

from __future__ import annotations

import pytest

from apps.runs import fingerprints
from apps.runs.limits import STACK_MAX_CHARS, cut_stack

# (type, message, the group it reads as)
NORMALISED = [
    ("KeyError", "'user 123'", "KeyError: '<str>'"),
    ("KeyError", '"email"', 'KeyError: "<str>"'),
    ("TimeoutError", "upstream timed out after 30 s (request 4242)",
     "TimeoutError: upstream timed out after <n> s (request <n>)"),
    ("ValueError", "bad amount 12.50 for order 991", "ValueError: bad amount <n> for order <n>"),
    ("LookupError", "no order 5f2c1e9a-1111-2222-3333-444455556666",
     "LookupError: no order <uuid>"),
    ("LookupError", "no order 5F2C1E9A-1111-2222-3333-444455556666",
     "LookupError: no order <uuid>"),
    ("MemoryError", "segment at 0x7f3a9b00 freed twice", "MemoryError: segment at <hex> freed twice"),
    ("GitError", "commit 3f2a9c1e4b not found", "GitError: commit <hex> not found"),
    ("E", "object 507f1f77bcf86cd799439011 gone", "E: object <hex> gone"),
    # A word of the letters a-f alone is not an id; a long number is a number.
    ("E", "deadbeef and facade stay; 12345678901 goes", "E: deadbeef and facade stay; <n> goes"),
    ("E", "run_8K2 was leased twice", "E: run_<id> was leased twice"),
    # An apostrophe is not a quote: the quoted word after it still is.
    ("ConnectionError", "can't reach 'db-1' on port 5432",
     "ConnectionError: can't reach '<str>' on port <n>"),
    ("E", "ran `rm -rf /tmp/x1` for job-7", "E: ran `<str>` for job-<n>"),
    ("E", "  spaces\n\tand   lines  ", "E: spaces and lines"),
    ("", "no type 7", "no type <n>"),
    ("E", "", "E"),
    ("", "", ""),
    # The reaper's reasons name the worker or the attempt: the group is the reason.
    ("lease_expired", "lease of worker host-1/1234 expired without a heartbeat",
     "lease_expired: lease of worker <worker> expired without a heartbeat"),
    ("timed_out", "attempt 3 ran past timeoutSeconds (900 s)",
     "timed_out: attempt <n> ran past timeoutSeconds (<n> s)"),
]  # fmt: skip


@pytest.mark.parametrize(("error_type", "message", "expected"), NORMALISED)
def test_the_varying_parts_of_a_message_read_as_placeholders(error_type, message, expected):
    assert fingerprints.normalise(error_type, message) == expected


# Pairs of errors that are one group, and pairs that are two.
SAME = [
    (("KeyError", "'user 123'"), ("KeyError", "'user 456'")),
    (("KeyError", "'user 123'"), ("KeyError", "'email'")),
    (("TimeoutError", "request 1 timed out"), ("TimeoutError", "request 99999 timed out")),
    (("E", "id 5f2c1e9a-1111-2222-3333-444455556666"), ("E", "id 00000000-aaaa-bbbb-cccc-000000000000")),
    (("lease_expired", "lease of worker a/1 expired"), ("lease_expired", "lease of worker b/2 expired")),
    (("E", "x" * 1000 + " tail one"), ("E", "x" * 1000 + " tail two")),
]  # fmt: skip
DIFFERENT = [
    (("KeyError", "'user 123'"), ("IndexError", "'user 123'")),
    (("E", "connection refused"), ("E", "connection reset")),
    (("E", "'a' and 'b'"), ("E", "'a b'")),
]


@pytest.mark.parametrize(("one", "other"), SAME)
def test_errors_that_differ_only_in_what_varies_share_a_fingerprint(one, other):
    assert fingerprints.of(*one) == fingerprints.of(*other)


@pytest.mark.parametrize(("one", "other"), DIFFERENT)
def test_errors_of_another_type_or_wording_do_not(one, other):
    assert fingerprints.of(*one) != fingerprints.of(*other)


def test_a_fingerprint_fits_a_bigint_and_round_trips_through_its_hex_form():
    for error_type, message, _ in NORMALISED:
        value = fingerprints.of(error_type, message)
        assert -(2**63) <= value < 2**63
        assert fingerprints.from_hex(fingerprints.to_hex(value)) == value
        assert len(fingerprints.to_hex(value)) == 16
    assert fingerprints.of_error({"type": "KeyError", "message": "'a'"}) == fingerprints.of(
        "KeyError", "'b'"
    )
    assert fingerprints.of_error(None) == fingerprints.of("", "")
    for bad in ("", "abc", "0" * 15, "g" * 16, "0" * 17, "ABCDEF0123456789", None, 12):
        assert fingerprints.from_hex(bad) is None


@pytest.mark.parametrize("length", [0, 10, STACK_MAX_CHARS, STACK_MAX_CHARS + 1, 70_000, 10**6])
def test_a_stack_past_its_cap_keeps_its_end_under_a_line_counting_what_was_cut(length):
    stack = ("frame\n" * length)[: max(0, length - 12)] + "ValueError: x"[: min(length, 12)]
    cut = cut_stack(stack)
    assert len(cut) == min(len(stack), STACK_MAX_CHARS)
    assert cut.endswith(stack[-10:])
    if len(stack) <= STACK_MAX_CHARS:
        assert cut == stack
    else:
        head, kept = cut.split("\n", 1)
        assert head == f"[{len(stack) - len(kept)} characters cut]"
        assert stack.endswith(kept)
