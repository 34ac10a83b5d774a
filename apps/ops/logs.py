"""JSON lines for logs, with the fields that let one follow a run across processes.

Every record becomes one JSON object: time, level, logger, message, and whichever of the
context fields (`run_id`, `job`, `attempt`, `fencing_token`, `shard`, `node`, …) the call passed
in `extra`. `grep run_8K2` over the web, scheduler and worker logs then tells one run's story.
"""

from __future__ import annotations

import json
import logging

import orjson

from apps.runs.clock import format_timestamp

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
            "ts": format_timestamp(record.created),
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
        # orjson and `format_timestamp`: a run event (two a run, at INFO by default) cost 29-31 µs of
        # CPU with the standard library's encoder and `format_utc`, 13-18 µs with these and
        # without the caller lookup (apps/runs/logs.py; bench/README.md).
        try:
            return orjson.dumps(line, default=str).decode()
        except TypeError:  # an integer past 64 bits, which orjson refuses
            return json.dumps(line, default=str)
