from __future__ import annotations

import json
import math
from typing import Any

import orjson
from rest_framework import parsers
from rest_framework.exceptions import ParseError, ValidationError

from apps.runs import limits


class JSONObjectParser(parsers.JSONParser):
    """JSON bodies, with the parser's reason in the problem detail."""

    def parse(self, stream, media_type=None, parser_context=None):
        view = (parser_context or {}).get("view")
        return parse_json(
            stream.read(),
            items=getattr(view, "body_items", None),
            repeated_keys=getattr(view, "repeated_keys", False),
        )


def not_json(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """Why a body is not JSON, in words that fit it: orjson says "str is not valid UTF-8:
    surrogates not allowed" of any bytes that are not UTF-8."""
    try:
        raw.decode()
    except UnicodeDecodeError as bad:
        return f"it is not UTF-8 text (byte {bad.start} is not)"
    return str(exc)


class RefusedItem:
    """An item of a batch whose items are answered each on its own (the view's `body_items`)
    that holds a value no body may: it is answered 400 with these `errors` (keyed as within
    the item), and the rest of the batch goes on."""

    __slots__ = ("errors",)

    def __init__(self, errors: dict[str, list[str]]) -> None:
        self.errors = errors


def parse_json(raw: bytes, *, items: str | None = None, repeated_keys: bool = False) -> Any:
    """The body's JSON, refused (ParseError, or ValidationError naming where) when it is not
    JSON or holds what no body may: nesting past the limit, an integer past 64 bits, a NUL, a
    key given twice in one object (unless `repeated_keys`: the last is taken). With `items`,
    the key of a batch's items: such a value inside an item replaces that item with a
    RefusedItem instead."""
    limit = limits.json_max_depth()
    huge = False
    try:
        # orjson, like DRF's strict parser, refuses NaN and Infinity, and lone surrogates.
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg == "depth limit exceeded":  # orjson's own limit, far past ours
            raise ValidationError(
                {"body": [f"Nested deeper than {limit} levels of objects and lists."]}
            ) from exc
        if "infinity" not in exc.msg:
            raise ParseError(f"The body is not valid JSON: {not_json(raw, exc)}") from exc
        # A number past a 64-bit float's range (309 digits, 1e400): JSON all the same, read
        # so that it is refused where it stands (in a batch, its item alone).
        data, huge = read_huge_numbers(raw), True
    # orjson reads an integer past 64 bits as a float: refused rather than rounded.
    problems = limits.inexact_integers(raw)
    if huge:
        problems.extend(
            (keys, "The number is past a 64-bit float's range: send it as a string.")
            for keys, value in limits.walk(data)
            if type(value) is float and not math.isfinite(value)
        )
    # Whatever is accepted must render back: nested past the limit, a value was once stored and
    # then answered 500 on every list showing it. Counting brackets (6 µs for 100 results)
    # spares most bodies the walk.
    if raw.count(b"{") + raw.count(b"[") > limit:
        deep = too_deep(data, limit, items)
        problems.extend(
            (keys, f"Nested deeper than {limit} levels of objects and lists.") for keys in deep
        )
    # PostgreSQL's text and jsonb cannot hold U+0000, which JSON writes as \u0000: refuse it
    # here (400) rather than in the database (500). The byte search keeps the common case
    # cheap; the walk tells a real NUL from an escaped backslash followed by "u0000".
    if b"\\u0000" in raw:
        problems.extend(
            (keys, "Strings cannot contain the NUL character (\\u0000).")
            for keys in limits.nul_strings(data)
        )
    if not repeated_keys:
        problems.extend(keys_given_twice(raw))
    if problems:
        refuse(data, problems, items)
    return data


class _Repeated(dict):
    """An object read with keys given twice (`keys_given_twice`): which."""

    twice: list[str]


def keys_given_twice(raw: bytes) -> list[tuple[list[str | int], str]]:
    """Where an object of a JSON text gives a key twice. JSON leaves what that means to each
    reader (orjson, like most, takes the last): a proxy or a signature check that read the
    first would not agree with this server on what was sent, and the jobs file refuses it.
    Read again with the standard library, whose parser hands each object's pairs over: 250 µs
    for a 13 KB body of 100 results, where orjson takes 55 (measured), hence not on the worker
    protocol's calls (`repeated_keys`)."""
    found = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal found
        obj = dict(items)
        if len(obj) == len(items):
            return obj
        found = True
        marked = _Repeated(obj)
        seen: set[str] = set()
        marked.twice = sorted({key for key, _ in items if key in seen or seen.add(key)})
        return marked

    try:
        data = json.loads(raw, object_pairs_hook=pairs)
    except (RecursionError, ValueError):  # read by orjson already: too deep here, said there
        return []
    if not found:
        return []
    problems: list[tuple[list[str | int], str]] = []
    pending: list[tuple[list[str | int], Any]] = [([], data)]
    while pending:
        keys, node = pending.pop()
        if isinstance(node, dict):
            problems.extend(
                ([*keys, key], f'The key "{key}" is given twice in one object.')
                for key in getattr(node, "twice", ())
            )
            pending.extend(([*keys, key], child) for key, child in node.items())
        elif isinstance(node, list):
            pending.extend(([*keys, index], child) for index, child in enumerate(node))
    return problems


def read_huge_numbers(raw: bytes) -> Any:
    """A JSON body orjson refuses for a number past a double's range, read by the standard
    library (exact integers, such floats as infinity); ParseError when it is not JSON."""

    def constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(raw, parse_constant=constant, parse_int=limits.read_integer)
    except RecursionError:
        raise ParseError("The body is nested too deeply to be read.") from None
    except ValueError as exc:
        raise ParseError(f"The body is not valid JSON: {exc}") from None


def too_deep(data: Any, limit: int, items: str | None) -> list[list[str | int]]:
    """Where `data` nests past `limit`: in a batch of `items`, each item that does (a batch
    refuses its deep items alone), else the first place found."""
    keys = limits.too_deep_at(data, limit)
    within = batch_items(data, items)
    if keys is None or within is None or keys[0] != items:
        return [] if keys is None else [keys]
    # An item's own levels start two below the body's (the object, then the list).
    found = []
    for index, item in enumerate(within):
        inside = limits.too_deep_at(item, limit - 2)
        if inside is not None:
            found.append([items, index, *inside])
    return found


def batch_items(data: Any, items: str | None) -> list[Any] | None:
    if items is None or not isinstance(data, dict):
        return None
    within = data.get(items)
    return within if isinstance(within, list) else None


def refuse(data: Any, problems: list[tuple[list[str | int], str]], items: str | None) -> None:
    """Raise the problems found outside a batch's items; mark the items holding the others."""
    within = batch_items(data, items)
    body: dict[str, list[str]] = {}
    refused: dict[int, dict[str, list[str]]] = {}
    for keys, reason in problems:
        if within is not None and len(keys) >= 2 and keys[0] == items and isinstance(keys[1], int):
            where = limits.field_path(keys[2:])
            refused.setdefault(keys[1], {}).setdefault(where, []).append(reason)
        else:
            body.setdefault(limits.field_path(keys), []).append(reason)
    if body:
        raise ValidationError({where: sorted(set(reasons)) for where, reasons in body.items()})
    for index, errors in refused.items():
        within[index] = RefusedItem(
            {where: sorted(set(reasons)) for where, reasons in errors.items()}
        )
