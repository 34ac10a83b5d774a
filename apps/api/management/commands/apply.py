"""Sync a team's job definitions from a YAML (or JSON) file: show the diff, then apply it.

    python manage.py apply jobs.yaml [--team SLUG] [--dry-run] [--prune]

The file is `{"team": "billing", "jobs": [{...definition as in the API...}]}` (team optional when
--team is given). Nothing changes when any entry is invalid; every change is audited (source cli).
"""

from __future__ import annotations

import json
import math
import re
from datetime import date, datetime
from pathlib import Path
from typing import Any

import yaml
from django.core.management.base import BaseCommand, CommandError
from rest_framework.exceptions import ValidationError

from apps.api.errors import PayloadTooLarge
from apps.api.parsers import parse_json
from apps.api.shapes.jobs import parse_entry
from apps.audit.record import Actor
from apps.jobs import services, sync
from apps.jobs.models import DefinitionGone
from apps.runs import shards
from apps.teams.models import Team


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser) -> None:
        parser.add_argument("file")
        parser.add_argument("--team", help="the team's slug (overrides the file's `team`)")
        parser.add_argument("--dry-run", action="store_true", help="show the diff, change nothing")
        parser.add_argument(
            "--prune",
            action="store_true",
            help="delete the team's definitions missing from the file",
        )

    def handle(
        self, *args, file: str, team: str | None, dry_run: bool, prune: bool, **options
    ) -> None:
        path = Path(file)
        # Where the shards are now (`manage.py moveshard`): a command reads the map as a web
        # process does at each request.
        shards.refresh(force=True)
        document, node = read_document(path)
        if not isinstance(document, dict):
            raise CommandError(f"{file} must hold a mapping with a `jobs` list.")
        slug = team or document.get("team")
        owner = Team.objects.filter(slug=slug).first() if isinstance(slug, str) else None
        if owner is None:
            raise CommandError(f"Unknown team {slug!r}: give --team or a `team:` key.")
        # The entries go through what every JSON body goes through (`PUT /api/v1/jobs` takes
        # the same ones): integers past 64 bits, NUL, nesting past the limit, counted from the
        # file's own level (a payload the file took at 64 levels of its own could not be sent
        # back through the API).
        try:
            entries = parse_json(json.dumps({"jobs": document.get("jobs")}).encode())["jobs"]
        except ValidationError as exc:
            found = "; ".join(
                f"{_at(node, where)}: {' '.join(map(str, reasons))}"
                for where, reasons in exc.detail.items()
            )
            raise CommandError(f"{file} is not valid ({found}); nothing was changed.") from exc
        try:
            plan = sync.plan_sync(owner, sync.validate(entries, parse_entry), prune=prune)
        except PayloadTooLarge as exc:
            raise CommandError(f"{file}: {exc.detail}") from exc
        except services.NameTaken as exc:
            raise CommandError(f"{exc} Nothing was changed.") from exc
        except sync.SyncError as exc:
            for where, reasons in exc.errors.items():
                self.stderr.write(f"{_at(node, where)}: {' '.join(reasons)}")
            raise CommandError(f"{file} is not valid; nothing was changed.") from exc
        self._print(plan)
        if dry_run:
            self.stdout.write("Dry run: nothing was changed.")
            return
        try:
            sync.apply_sync(plan, Actor.cli(f"apply {path.name}"))
        except (DefinitionGone, services.NameTaken) as exc:
            raise CommandError(f"{exc} Nothing was changed: run apply again.") from exc
        except sync.PartlyApplied as exc:
            for name in exc.not_applied:
                self.stderr.write(f"not applied: {name}")
            raise CommandError(f"{exc}. Run apply again to make the rest.") from exc
        self.stdout.write(f"Applied: {self._counts(plan)}.")

    def _print(self, plan: sync.SyncPlan) -> None:
        marks = {"create": "+", "update": "~", "delete": "-"}
        for change in plan.changes:
            self.stdout.write(f"{marks[change.action]} {change.name}")
            for key in change.changed_fields():
                before = json.dumps(change.before[key], sort_keys=True)
                after = json.dumps(change.after[key], sort_keys=True)
                self.stdout.write(f"    {key}: {before} → {after}")
        self.stdout.write(self._counts(plan))

    @staticmethod
    def _counts(plan: sync.SyncPlan) -> str:
        counts = plan.summary()
        return ", ".join(
            f"{counts[key]} {key}" for key in ("create", "update", "delete", "unchanged")
        )


# A file this large is no jobs file: refused before it is decoded and read.
MAX_FILE_BYTES = 64 * 1024 * 1024
# Values a file may expand to through YAML aliases: a small file of aliases of aliases ("a
# billion laughs") would otherwise fill the memory before any check.
MAX_VALUES = 2_000_000


class _Loader(yaml.SafeLoader):
    """YAML as jobs files use it: a key given twice in a mapping is a mistake, not the last
    one winning (`team: alpha` then `team: beta` applied to beta)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    None, None, "merge keys (<<) are not supported: write the fields out",
                    key_node.start_mark,
                )  # fmt: skip
            key = self.construct_object(key_node, deep=True)
            # Compared as JSON will hold them: `1` and `"1"`, `on` and `"true"` are one key.
            text = _json_key(key)
            if text is None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r:.40} is no JSON key", key_node.start_mark
                )
            if text in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {text!r} is given twice", key_node.start_mark
                )
            seen.add(text)
        return super().construct_mapping(node, deep=deep)


# YAML 1.1, which PyYAML reads, wants a dot in a float: `1e25` was read as the text "1e25", so
# a payload's number became a string without a word. YAML 1.2 and JSON read it as the number.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def read_document(path: Path) -> tuple[Any, yaml.Node | None]:
    """The file's YAML (or JSON) as JSON values: YAML's timestamps as their ISO text; a file
    that is not UTF-8, not YAML, or holds what JSON cannot (sets, bytes, NaN, a reference to
    itself, more than MAX_VALUES values once its aliases are expanded) is a CommandError. With
    it, the file's node tree, which knows where each value was written (`_at`)."""
    try:
        raw = path.read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            raise CommandError(f"{path} is larger than {MAX_FILE_BYTES} bytes.")
        text = raw.decode("utf-8")
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            document = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except OSError as exc:
        raise CommandError(f"Cannot read {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise CommandError(f"{path} is not UTF-8 text: {exc}") from exc
    except yaml.YAMLError as exc:
        message = f"Cannot read {path}: {exc}".replace("<unicode string>", str(path))
        raise CommandError(message) from exc
    except RecursionError as exc:  # nested far past the limit the definitions state
        raise CommandError(f"{path} nests objects and lists too deeply.") from exc
    return _as_json(document, path), node


_STEP = re.compile(r"\[(\d+)\]|\.?([^.\[]+)")


def _at(node: yaml.Node | None, where: str) -> str:
    """`where` ("jobs[2].rateLimit.periodSeconds") with the line of the file it was written on:
    the field's own line, or its nearest enclosing one the file has (a missing field)."""
    line = None
    for index, key in _STEP.findall(where):
        if isinstance(node, yaml.SequenceNode) and index and int(index) < len(node.value):
            node = node.value[int(index)]
            written = node
        elif isinstance(node, yaml.MappingNode) and key:
            pair = next(((k, v) for k, v in node.value if k.value == key), None)
            if pair is None:
                break
            written, node = pair  # the key's line: a block mapping's value starts below it
        else:
            break
        line = written.start_mark.line + 1
    return f"{where} (line {line})" if line else where


def _as_json(document: Any, path: Path) -> Any:
    """`document` with YAML's dates as text; CommandError for what no JSON value is. Iterative,
    counting every value it visits, so aliases cannot expand it without bound."""
    root: list[Any] = [document]
    pending: list[tuple[Any, Any, Any, tuple[int, ...]]] = [(document, root, 0, ())]
    visited = 0
    while pending:
        value, parent, key, above = pending.pop()
        visited += 1
        if visited > MAX_VALUES:
            raise CommandError(
                f"{path} holds more than {MAX_VALUES} values once its YAML aliases are expanded."
            )
        if isinstance(value, dict | list):
            if id(value) in above:
                raise CommandError(f"{path} holds a value that contains itself (a YAML alias).")
            copy: Any = {} if isinstance(value, dict) else [None] * len(value)
            parent[key] = copy
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for child_key, child in items:
                if isinstance(value, dict):
                    child_key = _key_text(child_key, path)
                pending.append((child, copy, child_key, (*above, id(value))))
        elif isinstance(value, datetime | date):
            parent[key] = value.isoformat()
        elif isinstance(value, float) and not math.isfinite(value):
            raise CommandError(f"{path} holds {value!r}, which JSON has no number for.")
        elif value is None or isinstance(value, str | int | float | bool):
            parent[key] = value
        else:
            kind = type(value).__name__
            raise CommandError(f"{path} holds a {kind} ({value!r:.40}), which is no JSON value.")
    return root[0]


def _key_text(key: Any, path: Path) -> str:
    text = _json_key(key)
    if text is None:
        raise CommandError(f"{path}: the key {key!r:.40} is no JSON key.")
    return text


def _json_key(key: Any) -> str | None:
    """A mapping key as JSON writes it (YAML reads `on:` as true and `1:` as 1); None for one
    JSON has no key for (a list, a mapping)."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool) or key is None:
        return json.dumps(key)
    if isinstance(key, int | float) and math.isfinite(key):
        return json.dumps(key)
    if isinstance(key, datetime | date):
        return key.isoformat()
    return None
