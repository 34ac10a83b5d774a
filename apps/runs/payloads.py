"""Payloads: inline up to 4 KB, larger ones in object storage under a content-addressed key.

Storage goes through Django's storage API (the file system by default, an S3-compatible bucket
when django-storages is configured as the `payloads` storage). Keys are the SHA-256 of the JSON,
so a definition's large payload is stored once however many runs it has; a blob is deleted when
no run or definition refers to it any more (see `delete_unreferenced`).

A blob is shared by content, so a writer may find it stored and skip writing it just as the
last row referring to it is deleted: the deletion, not seeing the writer's uncommitted row, took
the blob away, and the run committed a moment later (answered 201) could never be leased. Both
now lock the blob's row in `runs_payloadblob` (control database) in key order: a writer from
before it looks until its transaction ends (its rows are then committed, and seen), the
deletion from before it looks for references until the blob is gone (the writer then finds it
missing and stores it again).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

import orjson
from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import storages
from django.db import connections, transaction

from apps.runs import shards

logger = logging.getLogger(__name__)

INLINE_LIMIT = 4 * 1024
PREFIX = "payloads/"


def canonical(value: Any) -> Any:
    """A JSON value as the database compares it: numbers by their decimal value, told apart
    from strings. A stored payload reads back as PostgreSQL wrote it (1e25 as the integer
    10000000000000000000000000, which Python's float 1e25 is not equal to; 2.0 as 2.0, 1.50 as
    1.50): both sides of a comparison, and a digest, must not see a difference there."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        number = Decimal(repr(value))
        return "n" + str(number.normalize() if number else 0)  # -0 is 0
    if isinstance(value, str):
        return "s" + value
    if isinstance(value, dict):
        return {key: canonical(item) for key, item in value.items()}
    if isinstance(value, list):
        return [canonical(item) for item in value]
    return value


def same_json(a: Any, b: Any) -> bool:
    """Whether two JSON values are equal as the database compares them (`canonical`): a retry
    that sends the same body must still match its run."""
    return canonical(a) == canonical(b)


def _storage():
    return storages["payloads"] if "payloads" in settings.STORAGES else storages["default"]


def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def size(value: Any) -> int:
    """Bytes of the value as compact UTF-8 JSON, as the payload cap and the inline limit count
    them. orjson: the 1 000 payloads of a bulk enqueue were measured in 25 ms by json.dumps,
    2 ms by orjson."""
    try:
        return len(orjson.dumps(value))
    except TypeError:  # an integer past 64 bits (only the standard library writes those)
        # UTF-8, not `encode`'s ASCII, where "é" is six bytes (\u00e9).
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


# A writer's hold on its blobs, until the caller's transaction on the control database ends
# (enqueue and definition changes write inside one: apps.runs.shards.writing). One statement,
# in key order: a batch spread over several shard databases holds all its blobs first
# (`hold_all`), since one hold per database's insert let two batches naming the same two blobs
# the other way round deadlock.
HOLD = """
INSERT INTO runs_payloadblob (key, placed_at)
SELECT k, now() FROM unnest(%(keys)s::text[]) AS k ORDER BY k
ON CONFLICT (key) DO UPDATE SET placed_at = excluded.placed_at
"""
# The deletion's: every candidate gets a row (blobs stored before rows were kept had none),
# then the rows are locked, waiting for the writers that hold them.
CLAIM_FOR_DELETION = """
INSERT INTO runs_payloadblob (key, placed_at)
SELECT k, now() FROM unnest(%(keys)s::text[]) AS k ORDER BY k
ON CONFLICT (key) DO NOTHING
"""
LOCK_FOR_DELETION = """
SELECT key FROM runs_payloadblob WHERE key = ANY(%(keys)s::text[]) ORDER BY key FOR UPDATE
"""
FORGET = "DELETE FROM runs_payloadblob WHERE key = ANY(%(keys)s::text[])"
# Unreferenced, but the storage failed to delete them (down, say), or unreferenced where looked
# for while a shard database could not be read: kept for `sweep_stranded`.
# A stranded blob a writer refers to again is no longer stranded.
STRAND = "UPDATE runs_payloadblob SET stranded_at = now() WHERE key = ANY(%(keys)s::text[])"
UNSTRAND = """
UPDATE runs_payloadblob SET stranded_at = NULL
WHERE key = ANY(%(keys)s::text[]) AND stranded_at IS NOT NULL
"""
# Served by payloadblob_stranded (stranded_at) WHERE stranded_at IS NOT NULL: only these rows.
STRANDED = """
SELECT key FROM runs_payloadblob WHERE stranded_at IS NOT NULL ORDER BY stranded_at LIMIT %(batch)s
"""


def place(value: Any) -> tuple[Any, str]:
    """Return (inline value, "") for a small payload, (None, key) once a large one is stored."""
    return place_all([value])[0]


def place_all(values: Iterable[Any]) -> list[tuple[Any, str]]:
    """`place` for each value. The blobs of the large ones are held (HOLD, one statement in key
    order) before they are looked for and stored: call inside the transaction on the control
    database whose rows will refer to them."""
    placed: list[tuple[Any, str]] = []
    blobs: dict[str, bytes] = {}
    for value in values:
        inline, key, data = _split(value)
        placed.append((inline, key))
        if key:
            blobs[key] = data
    if blobs:
        _hold(blobs)
        storage = _storage()
        for key, data in blobs.items():
            try:
                if not storage.exists(key):
                    storage.save(key, ContentFile(data))
            except Exception as exc:  # each storage backend raises its own; the caller's 503
                raise Unavailable(key, exc, "written to") from exc
    return placed


def hold_all(values: Iterable[Any]) -> None:
    """Hold the blobs of the large ones of `values` in one statement, in key order, inside the
    caller's transaction on the control database: a batch that then places them database by
    database takes no hold in an order of its own."""
    blobs = {key: data for _, key, data in map(_split, values) if key}
    if blobs:
        _hold(blobs)


def keys_of(values: Iterable[Any]) -> list[str]:
    """The storage keys the large ones of `values` are (or would be) kept under."""
    return sorted({key for _, key, _ in map(_split, values) if key})


def _split(value: Any) -> tuple[Any, str, bytes]:
    """(inline value, "", b"") for a small payload or none; (None, key, document) for a large."""
    if value is None:
        return None, "", b""
    if size(value) <= INLINE_LIMIT:
        return value, "", b""
    data = encode(value)
    return None, PREFIX + hashlib.sha256(data).hexdigest() + ".json", data


def _hold(blobs: dict[str, bytes]) -> None:
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(HOLD, {"keys": sorted(blobs)})


class Unavailable(Exception):
    """A payload kept in storage could not be read (its blob is gone, or the storage is down),
    or could not be stored."""

    def __init__(self, key: str, cause: BaseException, doing: str = "read from") -> None:
        # The cause's type only: its text may name the server's paths or the bucket.
        super().__init__(f"the payload {key} cannot be {doing} storage ({type(cause).__name__})")
        self.key = key


def _read(key: str) -> bytes:
    try:
        with _storage().open(key, "rb") as blob:
            return blob.read()
    except Exception as exc:  # each storage backend raises its own (OSError, S3's ClientError)
        raise Unavailable(key, exc) from exc


def document(text: str | None, key: str) -> orjson.Fragment | None:
    """A run's payload as the JSON text it is stored as (jsonb's text, or the stored blob),
    to be written into an answer unparsed; Unavailable when its blob cannot be read. The claim
    hands every lease's payload through: parsed and written again, a payload of 54 bytes cost
    0.85 µs, one of 800 bytes 4.8 µs; passed through, 0.3-0.5 µs whatever its size (`{}` costs
    the same either way)."""
    if key:
        return orjson.Fragment(_read(key))
    return None if text is None else orjson.Fragment(text)


def load(inline: Any, key: str) -> Any:
    """Return a run's or definition's payload, reading it from storage when it has a key;
    Unavailable when it cannot be read."""
    if not key:
        return inline
    return json.loads(_read(key))


def shown(inline: Any, key: str) -> tuple[Any, str]:
    """(payload, "") to show a run, or (None, why) when it is kept in storage and cannot be
    read: the run is still shown, cancelled or retried without it (its lease fails it with the
    reason instead)."""
    try:
        return load(inline, key), ""
    except Unavailable as exc:
        logger.warning("%s", exc, exc_info=exc.__cause__)
        return None, str(exc)


def delete_unreferenced(keys: Iterable[str]) -> int:
    """Delete the blobs among `keys` that no run or definition of any shard database refers to;
    return how many. A blob is shared by content, so by rows of several databases: while one of
    them cannot be read, nothing is deleted, and those no database that answered refers to are
    kept as stranded (their last referring row may be gone: nothing else would try again).

    Called once the rows referring to them are gone, committed: a storage that fails to delete
    is not the caller's failure (a job's DELETE answered 500 with the job gone). The blobs it
    failed on are logged and kept as stranded, for retention's `sweep_stranded`."""
    candidates = sorted({key for key in keys if key})
    if not candidates:
        return 0

    def referenced() -> set[str]:
        with shards.cursor() as cursor:
            cursor.execute(
                """
                SELECT k FROM unnest(%s::text[]) AS k
                WHERE EXISTS (SELECT 1 FROM runs_run WHERE payload_key = k)
                   OR EXISTS (SELECT 1 FROM jobs_jobdefinition WHERE payload_key = k)
                """,
                [candidates],
            )
            return {row[0] for row in cursor.fetchall()}

    with transaction.atomic(using=shards.CONTROL):
        with connections[shards.CONTROL].cursor() as cursor:
            cursor.execute(CLAIM_FOR_DELETION, {"keys": candidates})
            cursor.execute(LOCK_FOR_DELETION, {"keys": candidates})
        # Read where the shards are now, and again after: a shard moved meanwhile (its rows
        # copied to a database this process's map, a second old, did not name, then deleted
        # from the one it did) is looked for again. Seen unchanged after the look, any move
        # switches after it, while its rows were still where they were looked for.
        while True:
            shards.refresh(force=True)
            placed = shards.current_map()
            found, unavailable = shards.gather(referenced)
            shards.refresh(force=True)
            if shards.current_map() == placed:
                break
        used = set().union(*found)
        orphans = [key for key in candidates if key not in used]
        if unavailable:
            with connections[shards.CONTROL].cursor() as cursor:
                cursor.execute(STRAND, {"keys": orphans})
            return 0
        deleted = _delete_from_storage(orphans)
        with connections[shards.CONTROL].cursor() as cursor:
            cursor.execute(FORGET, {"keys": deleted})
            cursor.execute(STRAND, {"keys": orphans[len(deleted) :]})
            cursor.execute(UNSTRAND, {"keys": sorted(used)})
    return len(deleted)


def _delete_from_storage(keys: list[str]) -> list[str]:
    """Delete the blobs from storage in order; return those deleted, up to the first the
    storage failed on: it is taken for down, and the rest are not tried (each try against a
    bucket that does not answer can take the client's whole timeout)."""
    storage = _storage()
    for done, key in enumerate(keys):
        try:
            storage.delete(key)
        except Exception as exc:  # each storage backend raises its own (OSError, S3's ClientError)
            logger.warning(
                "payload storage failed to delete %s (%s): %d unreferenced blobs left for"
                " retention to delete",
                key, type(exc).__name__, len(keys) - done,
            )  # fmt: skip
            return keys[:done]
    return keys


def sweep_stranded(batch: int) -> int:
    """Delete the stranded blobs (unreferenced, the storage having failed to delete them), the
    oldest `batch` of them; return how many were deleted (0 while the storage still fails)."""
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(STRANDED, {"batch": batch})
        keys = [row[0] for row in cursor.fetchall()]
    return delete_unreferenced(keys)
