"""JSON lines for logs, with the fields that let one follow a run across processes.

Every record becomes one JSON object: time, level, logger, message, and whichever of the
context fields (`run_id`, `job`, `attempt`, `fencing_token`, `shard`, `node`, …) the call passed
in `extra`. `grep run_8K2` over the web, scheduler and worker logs then tells one run's story.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from apps.runs.clock import format_utc

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
            "ts": format_utc(datetime.fromtimestamp(record.created, UTC)),
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
        return json.dumps(line, default=str)
