"""Jobs as code: bring a team's definitions in line with a list kept in its repository.

The same plan serves `manage.py apply jobs.yaml` and `PUT /api/v1/jobs`: validate every entry
first (all or nothing), show the diff, then apply it in one transaction, each change audited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from apps.audit.record import Actor
from apps.jobs import services
from apps.jobs.models import DefinitionGone, JobDefinition, database_of
from apps.runs import payloads, shards


class SyncError(ValueError):
    """Some entries are invalid: `errors` maps "jobs[3].schedule.cron" to reasons."""

    def __init__(self, errors: dict[str, list[str]]) -> None:
        super().__init__(f"{len(errors)} invalid fields")
        self.errors = errors


class NamesTaken(SyncError):
    """Some listed names are other teams' jobs (`taken`: those definitions, with their teams):
    the API answers 403 and audits the attempt, as for any call naming another team's job."""

    def __init__(self, taken: list[JobDefinition]) -> None:
        names = sorted(definition.name for definition in taken)
        super().__init__({"jobs": [f"'{name}' belongs to another team." for name in names]})
        self.taken = taken


@dataclass
class Change:
    action: str  # create | update | delete
    name: str
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None

    def changed_fields(self) -> list[str]:
        if self.before is None or self.after is None:
            return []
        return sorted(
            key
            for key in self.after
            if not payloads.same_json(self.before.get(key), self.after.get(key))
        )

    def as_json(self) -> dict[str, Any]:
        answer: dict[str, Any] = {"action": self.action, "name": self.name}
        if self.action == "update":
            answer["fields"] = {
                key: {"before": self.before[key], "after": self.after[key]}
                for key in self.changed_fields()
            }
        return answer


@dataclass
class SyncPlan:
    team: Any
    changes: list[Change] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    specs: dict[str, services.DefinitionSpec] = field(default_factory=dict)

    def summary(self) -> dict[str, int]:
        counts = {"create": 0, "update": 0, "delete": 0}
        for change in self.changes:
            counts[change.action] += 1
        return {**counts, "unchanged": len(self.unchanged)}


class InvalidEntry(ValueError):
    """Raised by a parser for one entry: `errors` maps a field path to reasons."""

    def __init__(self, errors: dict[str, list[str]]) -> None:
        super().__init__("invalid entry")
        self.errors = errors


def validate(entries: Any, parse) -> dict[str, services.DefinitionSpec]:
    """Validate every entry with `parse(entry) -> DefinitionSpec` (raising InvalidEntry) and
    collect every error, so one run shows all the problems of the file."""
    if not isinstance(entries, list):
        raise SyncError({"jobs": ["Expected a list of job definitions."]})
    specs: dict[str, services.DefinitionSpec] = {}
    errors: dict[str, list[str]] = {}
    named: set[str] = set()
    for index, entry in enumerate(entries):
        # Named twice is said whatever else is wrong with either entry (it was said only once
        # both parsed: a file fixed for one error then failed on the other).
        name = entry.get("name") if isinstance(entry, dict) else getattr(entry, "name", None)
        if isinstance(name, str) and name in named:
            errors[f"jobs[{index}].name"] = [f"'{name}' appears twice."]
        if isinstance(name, str):
            named.add(name)
        try:
            spec = parse(entry)
        except InvalidEntry as exc:
            for path, reasons in exc.errors.items():
                errors.setdefault(f"jobs[{index}].{path}", []).extend(reasons)
            continue
        specs[spec.name] = spec
    if errors:
        raise SyncError(errors)
    return specs


def plan_sync(team, specs: dict[str, services.DefinitionSpec], *, prune: bool) -> SyncPlan:
    plan = SyncPlan(team=team, specs=specs)
    # The team's definitions on every shard database (the plan must see them all), with the
    # listed names taken by other teams, and those of jobs still being deleted.
    found, _ = shards.gather(
        lambda: (
            list(JobDefinition.objects.filter(team=team)),
            shards.with_teams(
                JobDefinition.objects.filter(name__in=list(specs)).exclude(team=team)
            ),
            list(
                JobDefinition.everything.filter(name__in=list(specs), deleting=True).values_list(
                    "name", flat=True
                )
            ),
        ),
        strict=True,
    )
    elsewhere = [definition for _, taken, _ in found for definition in taken]
    if elsewhere:
        raise NamesTaken(elsewhere)
    going = sorted(name for _, _, names in found for name in names)
    if going:  # what applying the plan would meet: a dry run says so too
        raise services.NameTaken(going[0], deleting=True)
    existing = {d.name: d for definitions, _, _ in found for d in definitions}
    for name, spec in sorted(specs.items()):
        current = existing.get(name)
        if current is None:
            plan.changes.append(Change("create", name, after=services.spec_snapshot(spec)))
            continue
        before = services.snapshot(current)
        wanted = services.spec_snapshot(
            services.as_stored(services.held(spec, current), current.schedule)
        )
        if payloads.same_json(before, wanted):
            plan.unchanged.append(name)
        else:
            plan.changes.append(Change("update", name, before=before, after=wanted))
    if prune:
        for name in sorted(set(existing) - set(specs)):
            plan.changes.append(Change("delete", name, before=services.snapshot(existing[name])))
    return plan


class PartlyApplied(Exception):
    """A database failed at its commit after others had committed (the sync is not two-phase):
    the changes of those are applied, with their audit events; the others are not. The same
    plan applied again finishes it (a sync is brought in line, not replayed)."""

    def __init__(self, applied: list[str], not_applied: list[str]) -> None:
        self.applied = applied
        self.not_applied = not_applied
        super().__init__(
            f"{len(applied)} of {len(applied) + len(not_applied)} changes were applied; a "
            f"database failed at its commit before {', '.join(not_applied)} could be"
        )


def apply_sync(plan: SyncPlan, actor: Actor) -> None:
    """Apply a plan in one transaction per database (`shards.writing_everywhere`); each change
    writes its own audit event. A job it deletes is marked deleted in that transaction, gone
    for every call from its commit; its runs then go in batches, after it (as a DELETE's).
    PartlyApplied when a database failed at its commit after others had committed."""
    doomed: list[services.Doomed] = []
    try:
        with shards.writing_everywhere():
            for change in plan.changes:
                if change.action == "create":
                    services.create_definition(plan.team, plan.specs[change.name], actor)
                    continue
                definition = JobDefinition.objects.named(change.name).filter(team=plan.team).first()
                if change.action == "update":
                    if definition is None:  # deleted by another client since the plan was made
                        raise DefinitionGone(change.name)
                    services.update_definition(definition, plan.specs[change.name], actor)
                    continue
                # A job to delete that another client deleted meanwhile is as the sync wants
                # it: the same sync sent again (a client's retry after its timeout, when the
                # first had applied) answered 404 over the whole body.
                try:
                    if definition is not None:
                        doomed.append(services.begin_delete(definition, actor))
                except DefinitionGone:
                    continue
    except shards.PartlyCommitted as exc:
        done = set(exc.committed)
        for marked in doomed:
            if marked.alias in done:
                services.finish_or_leave(marked)
        applied = [c.name for c in plan.changes if database_of(c.name) in done]
        not_applied = [c.name for c in plan.changes if database_of(c.name) not in done]
        raise PartlyApplied(applied, not_applied) from exc
    for marked in doomed:
        services.finish_or_leave(marked)
