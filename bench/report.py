"""The one table (text) and the JSON rows."""

from __future__ import annotations

from typing import Any

from bench.common import Row
from bench.systems import LABELS

PEERS = ("raw", "procrastinate", "celery")
ROLE_SHORT = {
    "web": "web",
    "worker": "wkr",
    "postgres": "pg",
    "redis": "redis",
    "producer": "prod",
    "scheduler": "sched",
    "bench": "bench",
}


def clean(row: Row) -> dict[str, Any]:
    out = row.as_dict()
    out["extra"] = {k: v for k, v in row.extra.items() if not k.startswith("_")}
    out["label"] = LABELS.get(row.system, row.system)
    return out


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    if value == float("inf"):
        return "inf"
    return f"{value:,.{digits}f}"


def _secs(value: float | None) -> str:
    if value is None:
        return "–"
    if value == float("inf"):
        return "inf"
    if value < 0.1:
        return f"{value * 1000:.0f}ms"
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}"


def _ratio(row: Row, peer: Row | None) -> str:
    if peer is None or not row.rate or not peer.rate:
        return "–"
    return f"{row.rate / peer.rate:.2f}"


def table(rows: list[Row]) -> str:
    index = {(r.scenario, r.config, r.system): r for r in rows}
    head = [
        "scenario",
        "system",
        "config",
        "runs",
        "runs/s",
        "×raw",
        "×procr",
        "×celery",
        "p50 s",
        "p99 s",
        "max s",
        "CPU-s/1k",
        "commits/1k",
        "peak RSS MB",
        "load",
        "note",
    ]
    lines = []
    for r in rows:
        d = r.as_dict()
        rss = " ".join(f"{ROLE_SHORT.get(k, k)}:{v:.0f}" for k, v in r.rss_mb.items())
        lines.append(
            [
                r.scenario,
                LABELS.get(r.system, r.system),
                r.config,
                _num(r.runs),
                _num(r.rate),
                *(_ratio(r, index.get((r.scenario, r.config, p))) for p in PEERS),
                _secs(r.p50),
                _secs(r.p99),
                _secs(r.max),
                _num(d["cpu_s_per_1k"], 2),
                _num(d["commits_per_1k"], 1),
                rss,
                "→".join(f"{x:.1f}" for x in r.load),
                r.note,
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    right = {3, 4, 5, 6, 7, 8, 9, 10, 11, 12}

    def fmt(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(
                (str(c).rjust(w) if i in right else str(c).ljust(w))
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
            + " |"
        )

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":" if i in right else "-" * (w + 2)) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([fmt(head), sep, *(fmt(line) for line in lines)])
