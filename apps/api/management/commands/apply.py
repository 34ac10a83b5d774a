"""Sync a team's job definitions from a YAML (or JSON) file: show the diff, then apply it.

    python manage.py apply jobs.yaml [--team SLUG] [--dry-run] [--prune]

The file is `{"team": "billing", "jobs": [{...definition as in the API...}]}` (team optional when
--team is given). Nothing changes when any entry is invalid; every change is audited (source cli).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from django.core.management.base import BaseCommand, CommandError

from apps.api.shapes.jobs import parse_definition
from apps.audit.record import Actor
from apps.jobs import sync
from apps.runs import limits
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
        try:
            document = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise CommandError(f"Cannot read {file}: {exc}") from exc
        except RecursionError as exc:  # nested far past the limit the definitions state
            raise CommandError(f"{file} nests objects and lists too deeply.") from exc
        if not isinstance(document, dict):
            raise CommandError(f"{file} must hold a mapping with a `jobs` list.")
        slug = team or document.get("team")
        owner = Team.objects.filter(slug=slug).first() if slug else None
        if owner is None:
            raise CommandError(f"Unknown team {slug!r}: give --team or a `team:` key.")
        try:
            # YAML reads timestamps as datetimes; a JSON round trip gives the API's strings back.
            entries = json.loads(json.dumps(document.get("jobs"), default=str))
        except RecursionError as exc:
            raise CommandError(f"{file} nests objects and lists too deeply.") from exc
        # Counted from the file's own level, as `PUT /api/v1/jobs` counts its body's: the same
        # entries pass or fail both ways (a payload the file took at 64 levels of its own could
        # not be sent back through the API).
        where = limits.json_too_deep({"jobs": entries})
        if where is not None:
            raise CommandError(
                f"{file}: {where} nests objects and lists deeper than "
                f"{limits.json_max_depth()} levels, counted from the file's own."
            )
        try:
            plan = sync.plan_sync(owner, sync.validate(entries, parse_definition), prune=prune)
        except sync.SyncError as exc:
            for where, reasons in exc.errors.items():
                self.stderr.write(f"{where}: {'; '.join(reasons)}")
            raise CommandError(f"{file} is not valid; nothing was changed.") from exc
        self._print(plan)
        if dry_run:
            self.stdout.write("Dry run: nothing was changed.")
            return
        sync.apply_sync(plan, Actor.cli(f"apply {path.name}"))
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
