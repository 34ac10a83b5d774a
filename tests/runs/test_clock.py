from datetime import UTC, datetime, timedelta, timezone

import pytest

from apps.runs.clock import format_utc, read_iso


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (datetime(2026, 3, 29, 1, 0, tzinfo=UTC), "2026-03-29T01:00:00Z"),
        (datetime.fromisoformat("2026-03-29T03:00:00.999+02:00"), "2026-03-29T01:00:00.999Z"),
        (datetime.fromisoformat("2026-03-29T03:00:00.999999+02:00"), "2026-03-29T01:00:00.999Z"),
        (datetime.fromisoformat("2026-03-29T03:00:00.000400+02:00"), "2026-03-29T01:00:00.000Z"),
        (datetime(2026, 3, 28, 20, tzinfo=timezone(timedelta(hours=-5))), "2026-03-29T01:00:00Z"),
    ],
)
def test_format_utc_writes_utc_with_z_to_the_millisecond_when_there_is_a_fraction(value, expected):
    assert format_utc(value) == expected


def test_format_utc_keeps_none_and_rejects_naive_times():
    assert format_utc(None) is None
    with pytest.raises(ValueError, match="aware"):
        format_utc(datetime(2026, 3, 29, 1))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("2027-01-01T10:00:00Z", datetime(2027, 1, 1, 10, tzinfo=UTC)),
        ("2027-01-01t10:00:00z", datetime(2027, 1, 1, 10, tzinfo=UTC)),  # RFC 3339 allows both
        ("2027-01-01T10:00:00+05:30", datetime(2027, 1, 1, 4, 30, tzinfo=UTC)),
        ("2027-01-01T10:00:00+05:30:15", None),  # not in whole minutes
        ("2027-01-01T10:00:00Z\n", None),
        ("２０２７-01-01T10:00:00Z", None),
        ("z", None),
    ],
)
def test_read_iso_takes_what_rfc_3339_writes(raw, expected):
    value = read_iso(raw)
    assert (value if value is None else value.astimezone(UTC)) == expected
