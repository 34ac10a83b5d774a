"""The shard map: which PostgreSQL database holds which shards (`SCHEDULER_SHARD_DATABASES`).

`0-7=postgresql://db-a/sched;8-15=postgresql://db-b/sched` puts shards 0–7 on db-a and 8–15 on
db-b. Unset, every shard is on `DATABASE_URL`, the control database. The map is read once, when
settings load; `apps/runs/shards.py` routes by it at run time.

Each distinct URL is one Django database alias: `default` for the control database's own URL,
else `shards_1`, `shards_2`, … in the order the map first names them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class ShardMapError(ValueError):
    """The map does not parse, or does not place every shard exactly once."""


@dataclass(frozen=True)
class ShardMap:
    """`aliases[n]` is the database alias of shard n; `urls` the URL of each alias other than
    `default`, in the order of their aliases."""

    aliases: tuple[str, ...]
    urls: dict[str, str] = field(default_factory=dict)

    @property
    def physical(self) -> bool:
        """Whether some shard lives outside the control database."""
        return bool(self.urls)


def parse(text: str, shard_count: int, control_url: str) -> ShardMap:
    """The map written in `text` (empty: every shard on the control database)."""
    if not text.strip():
        return ShardMap(("default",) * shard_count)
    placed: dict[int, str] = {}
    alias_of_url = {control_url.strip(): "default"}
    urls: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        where, sep, url = entry.partition("=")
        url = url.strip()
        match = _RANGE.fullmatch(where.strip())
        if not sep or match is None:
            raise ShardMapError(f"'{entry}' is not RANGE=URL (e.g. 0-7=postgresql://host/db).")
        if not url.startswith(("postgresql://", "postgres://")):
            raise ShardMapError(f"'{entry}': the URL must start with postgresql://.")
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if first > last or last >= shard_count:
            raise ShardMapError(
                f"'{where.strip()}' is not a range of shards 0-{shard_count - 1} (low-high)."
            )
        alias = alias_of_url.get(url)
        if alias is None:
            alias = alias_of_url[url] = f"shards_{len(urls) + 1}"
            urls[alias] = url
        for shard in range(first, last + 1):
            if shard in placed:
                raise ShardMapError(f"Shard {shard} is placed twice.")
            placed[shard] = alias
    missing = [n for n in range(shard_count) if n not in placed]
    if missing:
        raise ShardMapError(f"Shards {ranges(missing)} are on no database.")
    return ShardMap(tuple(placed[n] for n in range(shard_count)), urls)


def relocated(base: ShardMap, moved: dict[int, str], control_url: str) -> ShardMap:
    """`base` with the shards of `moved` on their new URLs (`manage.py moveshard`). A URL the map
    already names keeps its alias; another gets one named after it, so that an alias always
    means the same server in a process however many moves it sees."""
    alias_of_url = {control_url.strip(): "default", **{u: a for a, u in base.urls.items()}}
    urls = dict(base.urls)
    aliases = list(base.aliases)
    for shard, url in moved.items():
        alias = alias_of_url.get(url)
        if alias is None:
            alias = alias_of_url[url] = moved_alias(url)
            urls[alias] = url
        aliases[shard] = alias
    held = set(aliases)
    return ShardMap(tuple(aliases), {a: u for a, u in urls.items() if a in held})


def spread(shard_count: int, urls: list[str]) -> str:
    """The map of `shard_count` shards in contiguous ranges of near-equal size over `urls`, in
    their order (16 over three: 0-4, 5-9, 10-15)."""
    entries, start = [], 0
    for n, url in enumerate(urls):
        end = (n + 1) * shard_count // len(urls)
        entries.append(f"{start}-{end - 1}={url}")
        start = end
    return ";".join(entries)


def moved_alias(url: str) -> str:
    """The alias of a database that the map did not name and a shard was moved to."""
    return "moved_" + hashlib.sha256(url.encode()).hexdigest()[:12]


def render(aliases: tuple[str, ...], url_of: dict[str, str]) -> str:
    """The map's text for shard aliases and their URLs: what `parse` reads back."""
    entries = []
    start = 0
    for shard in range(1, len(aliases) + 1):
        if shard == len(aliases) or aliases[shard] != aliases[start]:
            span = f"{start}" if shard - 1 == start else f"{start}-{shard - 1}"
            entries.append(f"{span}={url_of[aliases[start]]}")
            start = shard
    return ";".join(entries)


def ranges(numbers: list[int]) -> str:
    """Shard numbers, in order, as ranges: [0, 1, 2, 5, 7, 8] → "0-2,5,7-8"."""
    spans: list[str] = []
    for n in numbers:
        if spans and n - 1 == int(spans[-1].split("-")[-1]):
            spans[-1] = f"{spans[-1].split('-')[0]}-{n}"
        else:
            spans.append(str(n))
    return ",".join(spans)
