"""JSON lines for logs, with the fields that let one follow a run across processes.

Every record becomes one JSON object: time, level, logger, message, and whichever of the
context fields (`run_id`, `job`, `attempt`, `fencing_token`, `shard`, `node`, …) the call passed
in `extra`. `grep run_8K2` over the web, scheduler and worker logs then tells one run's story.
"""

from __future__ import annotations

import json
import logging
import time

import orjson

CONTEXT_FIELDS = (
    "run_id",
    "job",
    "attempt",
    "fencing_token",
    "queue",
    "worker_id",
    "state",
    "outcome",
    "shard",
    "epoch",
    "node",
    "team",
    "count",
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": _instant(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        # orjson and `_instant`: a run event (two a run, at INFO by default) cost 29-31 µs of
        # CPU with the standard library's encoder and `format_utc`, 13-18 µs with these and
        # without the caller lookup (apps/runs/logs.py; bench/README.md).
        try:
            return orjson.dumps(line, default=str).decode()
        except TypeError:  # an integer past 64 bits, which orjson refuses
            return json.dumps(line, default=str)


# The last second written, and its text: a log line's time is that text and the milliseconds.
_second: tuple[int, str] = (-1, "")


def _instant(created: float) -> str:
    """`created` as `format_utc` writes an instant, always to the millisecond (`…T10:55:41.837Z`)."""
    global _second
    whole = int(created)
    # To the microsecond first, as datetime.fromtimestamp rounds (…41.837 is …41.83699… as a float).
    micro = round((created - whole) * 1e6)
    if micro == 1_000_000:
        whole, micro = whole + 1, 0
    second = _second  # one read: other threads may replace it
    if second[0] != whole:
        second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
        _second = second
    return f"{second[1]}.{micro // 1000:03d}Z"
