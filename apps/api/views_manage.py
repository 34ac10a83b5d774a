"""The management API: job definitions, runs and the dead-letter queue of the token's team."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, ClassVar

from django.http import HttpRequest
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from pydantic_core import PydanticCustomError
from rest_framework import status
from rest_framework.exceptions import MethodNotAllowed, NotFound, PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from apps.api import schema as doc
from apps.api.errors import (
    Conflict,
    PayloadTooLarge,
    PreconditionFailed,
    ShardUnavailable,
    flatten_errors,
    problem,
)
from apps.api.fastpath import Call, FastPathView
from apps.api.serializers import definition_json, run_detail_json, run_json
from apps.api.shapes import M, body_size, parse, parse_each
from apps.api.shapes import jobs as job_shape
from apps.api.shapes import runs as run_shape
from apps.api.throttling import charge_enqueue
from apps.audit.record import Actor, record_denied
from apps.jobs import enqueue, runlist, services, sync
from apps.jobs import schedule as sched
from apps.jobs.models import JobDefinition, database_of
from apps.runs import filters, limits, shards, transitions
from apps.runs.clock import database_now
from apps.runs.ids import parse_run_id, public_run_id
from apps.runs.models import PRIORITIES, Run, State
from apps.teams import access
from scheduler_site.database import RETRY_AFTER_SECONDS


class ManageView(APIView):
    required_scope = "manage"
    # The methods whose calls take no body: one sent anyway (bar an empty object, which clients
    # send by habit) is a 400, as an unknown field is elsewhere, not silently ignored.
    bodyless: frozenset[str] = frozenset({"DELETE"})
    # The query parameters each method reads, as its OpenAPI description declares them; any
    # other is a 400, as an unknown field of a body is: `?error=boom` or `?stat=dead` listed
    # every run as if no filter had been asked for.
    query: ClassVar[Mapping[str, Sequence[OpenApiParameter]]] = {}

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        # A method the path does not take is a 405 before its query or body is judged: "takes
        # no body" for a DELETE of a list said the call existed.
        method = (request.method or "").lower()
        if method not in self.http_method_names or not hasattr(self, method):
            raise MethodNotAllowed(request.method)
        # A parameter given twice was read as its last value: `?state=dead&state=ready` listed
        # ready runs, and `?limit=600&limit=1` passed where `?limit=1&limit=600` did not.
        repeated = sorted(key for key, values in request.query_params.lists() if len(values) > 1)
        if repeated:
            raise ValidationError({key: ["Given more than once."] for key in repeated})
        # `?format=json` (DRF's override of the Accept header) goes with every call.
        declared = {api_settings.URL_FORMAT_OVERRIDE} | {
            parameter.name
            for parameter in self.query.get(request.method or "", ())
            if parameter.location == OpenApiParameter.QUERY
        }
        if unknown := sorted(set(request.query_params) - declared):
            known = sorted(declared - {api_settings.URL_FORMAT_OVERRIDE})
            takes = f"it takes {', '.join(known)}" if known else "it takes none"
            raise ValidationError(
                {key: [f"Not a parameter of this call ({takes})."] for key in unknown}
            )
        # Compared, not tested for truth: `[]`, `null`, `""` and `0` are bodies too.
        if request.method in self.bodyless and request.data != {}:
            raise ValidationError({"body": ["This call takes no body."]})

    @staticmethod
    def body(request: Request, model: type[M], data: Any = None) -> M:
        """The request's body (or `data` made from it) validated as `model`; a 400 otherwise."""
        return parse(model, request.data if data is None else data, body_size=body_size(request))

    def actor(self, request: Request) -> Actor:
        return Actor.for_token(request.auth)

    def team(self, request: Request):
        return request.auth.team

    def team_ids(self, request: Request) -> list[int]:
        return access.visible_team_ids(request.user)

    def _deny(self, request: Request, team, target_type: str, target: str | list[str]) -> None:
        """Record an attempt on another team's object (the caller then answers 403 for a job,
        whose names are one namespace for every team, and 404 for a run)."""
        record_denied(
            self.actor(request),
            f"{request.method} {request.path}",
            team=team,
            target_type=target_type,
            target=target,
        )

    def _refuse_taken(self, request: Request, name: str, team) -> None:
        """403, audited, when the name is another team's job (names are one namespace)."""
        owner = _owner_elsewhere(name, team)
        if owner is not None:
            self._deny(request, owner.team, "job", name)
            raise PermissionDenied(f"The job name '{name}' belongs to another team.")

    @staticmethod
    def job_answer(definition: JobDefinition, code: int = status.HTTP_200_OK) -> Response:
        """A job's representation, with its version as the ETag (one snapshot for both: a
        payload kept in storage is read once)."""
        fields = services.snapshot(definition)
        return Response(
            definition_json(definition, fields),
            status=code,
            headers={"ETag": f'"{services.version_of(fields)}"'},
        )

    @staticmethod
    def versions(request: Request) -> services.Versions:
        """The versions an If-Match names, for a change made only to a job still at one of
        them (compared under its lock); None without one, or with `*` (any version: the
        lookup already requires the job). Strong comparison, as RFC 9110 has for If-Match: a
        weak tag matches no version. A bare tag without its quotes is read as one (versions
        hold no comma)."""
        header = request.headers.get("If-Match")
        if header is None:
            return None
        tags = [tag.strip() for tag in header.split(",")]
        if tags == ["*"]:
            return None
        return {tag.strip('"') for tag in tags if not tag.startswith("W/")}

    def definition(self, request: Request, name: str) -> JobDefinition:
        """The job named in the path: 404 when there is none, 403 when it is another team's (a
        name is taken for every team: PUT and POST already say so)."""
        # Not a job name (PostgreSQL text cannot hold the NUL some carry): no such job.
        reason = limits.job_name_problem(name)
        if reason is not None:
            raise NotFound(f"No job named {name[:200]!r}: {reason}")
        with shards.reaching(database_of(name)):
            found = shards.with_teams(JobDefinition.objects.named(name))
        definition = found[0] if found else None
        if definition is None:
            raise NotFound(f"No job named '{name}'.")
        if access.role_in(request.user, definition.team_id) is None:
            self._deny(request, definition.team, "job", name)
            raise PermissionDenied(f"The job '{name}' belongs to another team.")
        return definition

    def run(self, request: Request, run_id: str) -> Run:
        pk = parse_run_id(run_id)
        run = None
        if pk is not None:
            # From the database its id names (apps/runs/shards.py); 503 while it is down.
            with shards.reaching(shards.alias_of_run(pk)):
                found = shards.with_teams(Run.objects.select_related("definition").filter(pk=pk))
            run = found[0] if found else None
        if run is not None and access.role_in(request.user, run.team_id) is None:
            self._deny(request, run.team, "run", run_id)
            run = None
        if run is None:
            raise NotFound("No such run.")
        return run


def _named(data: Any, name: str) -> Any:
    """The body with the name of the path (a name in the body must be the same)."""
    if not isinstance(data, dict):
        return data
    if "name" in data and data["name"] != name:
        raise ValidationError({"name": [f"Does not match the name in the path ('{name}')."]})
    return {**data, "name": name}


def _dropped_unknown(changes: dict[str, Any]) -> list[str]:
    """The fields a PATCH drops (a null) that no definition has: dropped before the merged
    definition is validated, a misspelt name meant to clear a field was accepted, and changed
    nothing."""
    found = [
        key for key, value in changes.items()
        if value is None and key not in job_shape.Definition.model_fields
    ]  # fmt: skip
    nested = {
        "retry": job_shape.Retry.model_fields.keys(),
        "schedule": sched.CRON_KEYS | sched.ONE_OFF_KEYS | sched.DELAYED_KEYS,
    }
    for key, fields in nested.items():
        given = changes.get(key)
        if isinstance(given, dict):
            found += [f"{key}.{k}" for k, v in given.items() if v is None and k not in fields]
    return found


def _amends_cron(current: Any, given: Any) -> bool:
    """Whether a PATCH's `schedule` changes fields of the job's cron schedule (rather than
    giving a schedule of another kind, or none: `{}`)."""
    return (
        isinstance(current, dict)
        and "cron" in current
        and isinstance(given, dict)
        and bool(given)
        and not given.keys() & {"runAt", "delaySeconds"}
    )


def _owner_elsewhere(name: str, team) -> JobDefinition | None:
    """Another team's job of this name (with its team), if there is one."""
    with shards.reaching(database_of(name)):
        found = shards.with_teams(JobDefinition.objects.named(name).exclude(team=team))
    return found[0] if found else None


class JobsView(ManageView):
    @extend_schema(
        operation_id="listJobs",
        summary="List job definitions",
        description="Every definition of the token's team, by name. Needs the `manage` scope.",
        tags=["jobs"],
        responses=doc.responses({200: job_shape.DefinitionList}),
    )
    def get(self, request: Request) -> Response:
        team = self.team(request)
        found, unavailable = shards.gather(
            lambda: list(JobDefinition.objects.filter(team=team).order_by("name"))
        )
        definitions = sorted((d for part in found for d in part), key=lambda d: d.name)
        for definition in definitions:
            definition.team = team
        answer = job_shape.DefinitionList(results=[definition_json(d) for d in definitions])
        if unavailable:
            answer["unavailableShards"] = unavailable
        return Response(answer)

    @extend_schema(
        operation_id="createJob",
        summary="Create a job definition",
        description=(
            "Create a definition; omitted fields take their defaults. An existing name is a "
            "409 (use PUT to replace), a name of another team's job a 403. "
            "Needs the `manage` scope."
        ),
        tags=["jobs"],
        parameters=[doc.ETAG],
        request=job_shape.Definition,
        responses=doc.responses(
            {201: job_shape.DefinitionAnswer},
            *doc.BODY_PROBLEMS,
            409,
            e403="The token lacks the `manage` scope, or the name belongs to another team.",
            e409="A job with this name exists, or is still being deleted.",
        ),
    )
    def post(self, request: Request) -> Response:
        spec = self.body(request, job_shape.Definition).to_spec()
        team = self.team(request)
        self._refuse_taken(request, spec.name, team)
        with shards.reaching(database_of(spec.name)):
            exists = JobDefinition.objects.named(spec.name).exists()
        if exists:
            raise Conflict(f"A job named '{spec.name}' exists; use PUT to replace it.")
        try:
            definition = services.create_definition(team, spec, self.actor(request))
        except services.NameTaken as exc:
            raise Conflict(str(exc)) from exc
        return self.job_answer(definition, status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="syncJobs",
        summary="Sync the team's definitions to a list (jobs as code)",
        description=(
            "Create and update the listed definitions, and with `prune` delete the team's others. "
            "Every entry is validated first: one bad entry changes nothing. With `dryRun` only the "
            "diff is answered. Each change is audited. Needs the `manage` scope."
        ),
        tags=["jobs"],
        request=job_shape.SyncRequest,
        responses=doc.responses(
            {200: job_shape.SyncAnswer, 207: job_shape.SyncAnswer},
            *doc.BODY_PROBLEMS,
            409,
            e409="A job to create was created by another client meanwhile, or is being deleted.",
        ),
    )
    def put(self, request: Request) -> Response:
        body = self.body(request, job_shape.SyncRequest)
        try:
            specs = sync.validate(body.jobs, job_shape.Definition.to_spec)
            plan = sync.plan_sync(self.team(request), specs, prune=body.prune)
        except services.NameTaken as exc:  # still being deleted
            raise Conflict(f"Nothing was changed: {exc}") from exc
        except sync.NamesTaken as exc:
            by_team: dict[int, tuple[Any, list[str]]] = {}
            for definition in exc.taken:
                by_team.setdefault(definition.team_id, (definition.team, []))[1].append(
                    definition.name
                )
            for owner, names in by_team.values():  # one audit event per team tried
                self._deny(request, owner, "job", sorted(names))
            raise PermissionDenied(" ".join(exc.errors["jobs"])) from exc
        except sync.SyncError as exc:
            raise ValidationError(exc.errors) from exc
        not_applied = {change.name for change in plan.changes} if body.dryRun else set()
        try:
            if not body.dryRun:
                sync.apply_sync(plan, self.actor(request))
        except services.NameTaken as exc:  # created (or not yet deleted) meanwhile
            raise Conflict(f"Nothing was changed: {exc}") from exc
        except sync.PartlyApplied as exc:
            # Not a 5xx: some changes committed, and the answer says which (a client that read
            # a 503 as "nothing changed" would be wrong).
            answer = self.sync_answer(plan, set(exc.not_applied), applied=True, complete=False)
            answer["detail"] = (
                f"{exc}. Send the same body again to make the rest: a sync brings the jobs in "
                "line with it, so what was made is left as it is."
            )
            return Response(
                answer,
                status=status.HTTP_207_MULTI_STATUS,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        return Response(self.sync_answer(plan, not_applied, applied=not body.dryRun))

    @staticmethod
    def sync_answer(
        plan: sync.SyncPlan, not_applied: set[str], *, applied: bool, complete: bool = True
    ) -> job_shape.SyncAnswer:
        return job_shape.SyncAnswer(
            changes=[
                sync_change_json(change, change.name not in not_applied) for change in plan.changes
            ],
            summary=job_shape.SyncSummary(**plan.summary()),
            applied=applied,
            complete=complete,
        )


def sync_change_json(change: sync.Change, applied: bool) -> job_shape.SyncChange:
    answer = job_shape.SyncChange(action=change.action, name=change.name, applied=applied)
    if change.action == "update":
        answer["fields"] = {
            key: job_shape.FieldChange(before=change.before[key], after=change.after[key])
            for key in change.changed_fields()
        }
    return answer


class JobDetailView(ManageView):
    @extend_schema(
        operation_id="getJob",
        summary="Get a job definition",
        description="Needs the `manage` scope.",
        tags=["jobs"],
        parameters=[doc.JOB_NAME, doc.ETAG],
        responses=doc.responses({200: job_shape.DefinitionAnswer}, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        return self.job_answer(self.definition(request, name))

    @extend_schema(
        operation_id="replaceJob",
        summary="Create or replace a job definition",
        description=(
            "Jobs as code: create the definition named in the path (201) or replace it (200); "
            "omitted fields take their defaults, but for `paused` and `dryRun`, which a "
            "replacement that leaves them out keeps as they are. With `If-Match`, only replace "
            "the job at that version (412 otherwise, also when there is no job); with "
            "`If-None-Match: *`, only create (412 when it exists). Needs the `manage` scope."
        ),
        tags=["jobs"],
        parameters=[doc.JOB_NAME, doc.IF_MATCH, doc.IF_NONE_MATCH, doc.ETAG],
        request=job_shape.DefinitionReplace,
        responses=doc.responses(
            {200: job_shape.DefinitionAnswer, 201: job_shape.DefinitionAnswer},
            *doc.BODY_PROBLEMS,
            409,
            412,
            e403="The token lacks the `manage` scope, or the name belongs to another team.",
            e412=(
                "The job is not at the version `If-Match` names, or there is none to match; or it "
                "exists and `If-None-Match: *` was sent: nothing was changed."
            ),
            e409=(
                "A job with this name is still being deleted, or was created and deleted again"
                " while this call ran."
            ),
        ),
    )
    def put(self, request: Request, name: str) -> Response:
        """Create or replace a definition by name: jobs as code."""
        team = self.team(request)
        problem_of_name = limits.job_name_problem(name)
        if problem_of_name is not None:
            raise ValidationError({"name": [problem_of_name]})
        self._refuse_taken(request, name, team)
        # A replacement states its queue (DefinitionReplace): an empty body would otherwise
        # create (or reset a job to) every default, never what a jobs-as-code file means.
        spec = self.body(request, job_shape.DefinitionReplace, _named(request.data, name)).to_spec()
        versions = self.versions(request)
        create_only = request.headers.get("If-None-Match", "").strip() == "*"
        with shards.reaching(database_of(name)):
            existing = JobDefinition.objects.named(name).filter(team=team).first()
        if existing is not None and create_only:
            raise PreconditionFailed(
                f"A job named '{name}' exists (If-None-Match: *): nothing was changed.",
                f'"{services.version(existing)}"',
            )
        if existing is None:
            if "If-Match" in request.headers:
                raise PreconditionFailed(f"No job named '{name}' to match (If-Match).")
            try:
                definition = services.create_definition(team, spec, self.actor(request))
            except services.NameTaken as exc:
                if exc.deleting:
                    raise Conflict(str(exc)) from exc
                if create_only:
                    raise PreconditionFailed(
                        f"A job named '{name}' was created meanwhile (If-None-Match: *)."
                    ) from exc
                # Another PUT of the name created it first: this one replaces it, as a PUT of
                # a name that exists does (two deploys applying the same file at once).
                self._refuse_taken(request, name, team)
                with shards.reaching(database_of(name)):
                    existing = JobDefinition.objects.named(name).filter(team=team).first()
                if existing is None:
                    raise Conflict(f"The job '{name}' was created and deleted meanwhile.") from exc
            else:
                return self.job_answer(definition, status.HTTP_201_CREATED)
        definition = services.update_definition(
            existing, spec, self.actor(request), versions=versions
        )
        return self.job_answer(definition)

    @extend_schema(
        operation_id="updateJob",
        summary="Change some fields of a job definition",
        description=(
            "Merge the given fields into the definition (`retry` is merged field by field, and "
            "so is a cron `schedule` given without `runAt` or `delaySeconds`: a null drops a "
            "field). "
            "Needs the `manage` scope."
        ),
        tags=["jobs"],
        parameters=[doc.JOB_NAME, doc.IF_MATCH, doc.ETAG],
        request=job_shape.DefinitionPatch,
        responses=doc.responses({200: job_shape.DefinitionAnswer}, *doc.BODY_PROBLEMS, 404, 412),
    )
    def patch(self, request: Request, name: str) -> Response:
        definition = self.definition(request, name)
        if not isinstance(request.data, dict):
            raise ValidationError({"body": ["Expected a JSON object."]})
        changes = request.data
        if unknown := _dropped_unknown(changes):
            raise ValidationError(dict.fromkeys(unknown, ["Unknown field."]))

        def amended(current: dict[str, Any]) -> services.DefinitionSpec:
            # Merged into the fields as they are under the row's lock (services), so a pause
            # or another PATCH made meanwhile stays. JSON merge patch: a null drops a field,
            # which then takes its default (as in a PUT that leaves it out); `retry` merges
            # field by field.
            merged = dict(current)
            for key, value in changes.items():
                if value is None:
                    merged.pop(key, None)
                elif key == "retry" and isinstance(value, dict):
                    retry = {**merged["retry"], **value}
                    merged["retry"] = {k: v for k, v in retry.items() if v is not None}
                elif key == "schedule" and _amends_cron(merged["schedule"], value):
                    # A new cron expression keeps the job's time zone, jitter and policies; a
                    # null drops a field. Another kind of schedule replaces it whole.
                    schedule = {**merged["schedule"], **value}
                    merged["schedule"] = {k: v for k, v in schedule.items() if v is not None}
                else:
                    merged[key] = value
            spec = self.body(request, job_shape.Definition, _named(merged, name)).to_spec()
            return replace(spec, keeps=frozenset())  # a switch nulled here takes its default

        return self.job_answer(
            services.update_definition(
                definition, amended, self.actor(request), versions=self.versions(request)
            )
        )

    @extend_schema(
        operation_id="deleteJob",
        summary="Delete a job definition",
        description="Needs the `manage` scope.",
        tags=["jobs"],
        parameters=[doc.JOB_NAME, doc.IF_MATCH],
        request=None,
        responses=doc.responses({204: None}, 404, 412),
    )
    def delete(self, request: Request, name: str) -> Response:
        services.delete_definition(
            self.definition(request, name), self.actor(request), versions=self.versions(request)
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


class JobPauseView(ManageView):
    paused = True
    bodyless = frozenset({"POST"})

    @extend_schema(
        operation_id="pauseJob",
        summary="Pause a job",
        description=(
            "Stop new runs and stop the job's ready runs from being claimed. "
            "Needs the `manage` scope."
        ),
        tags=["jobs"],
        parameters=[doc.JOB_NAME, doc.IF_MATCH, doc.ETAG],
        request=None,
        responses=doc.responses({200: job_shape.DefinitionAnswer}, 404, 412),
    )
    def post(self, request: Request, name: str) -> Response:
        definition, _ = services.set_paused(
            self.definition(request, name),
            self.paused,
            self.actor(request),
            versions=self.versions(request),
        )
        return self.job_answer(definition)


@extend_schema_view(
    post=extend_schema(
        operation_id="resumeJob",
        summary="Resume a job",
        description=(
            "Resume a paused job; its next due time is recomputed from now (a pause is not "
            "back-filled). Needs the `manage` scope."
        ),
        tags=["jobs"],
        parameters=[doc.JOB_NAME, doc.IF_MATCH, doc.ETAG],
        request=None,
        responses=doc.responses({200: job_shape.DefinitionAnswer}, 404, 412),
    )
)
class JobResumeView(JobPauseView):
    paused = False


class JobTriggerView(ManageView):
    @extend_schema(
        operation_id="triggerJob",
        summary="Run a job now",
        description=(
            "Create a run due now, with the job's payload or the one given. Needs the "
            "`manage` scope."
        ),
        tags=["jobs"],
        parameters=[doc.JOB_NAME],
        request=run_shape.TriggerRun,
        responses=doc.responses({201: run_shape.Run}, *doc.BODY_PROBLEMS, 404),
    )
    def post(self, request: Request, name: str) -> Response:
        definition = self.definition(request, name)
        body = self.body(request, run_shape.TriggerRun)
        created = enqueue.create_run(
            definition,
            self.actor(request),
            idempotency_key=None,
            payload=body.payload,
            trigger="api",
            triggered=True,
        )
        return Response(run_json(created.run, database_now()), status=status.HTTP_201_CREATED)


class JobRunsView(ManageView):
    enqueue_methods = ("POST",)

    @extend_schema(
        operation_id="createJobRun",
        summary="Create a delayed or one-off run",
        description=(
            "Create a run after `delaySeconds` or at `runAt` (now if neither). The same "
            "`idempotencyKey` again answers the existing run (200); a new run is a 201. "
            "Needs the `manage` scope."
        ),
        tags=["jobs"],
        parameters=[doc.JOB_NAME],
        request=run_shape.CreateRun,
        responses=doc.responses(
            {
                200: OpenApiResponse(
                    run_shape.Run, description="The run with this idempotency key."
                ),
                201: OpenApiResponse(run_shape.Run, description="A new run."),
            },
            *doc.BODY_PROBLEMS,
            404,
            409,
            e409="The `idempotencyKey` names a run of this job made with another payload.",
        ),
    )
    def post(self, request: Request, name: str) -> Response:
        self.definition(request, name)  # another team's job: a 403, audited
        body = self.body(request, run_shape.CreateRun)
        item = {**body.model_dump(exclude_unset=True, mode="json"), "job": name}
        (answer,) = enqueue_items(self, request, [item], body_size(request))
        if answer["status"] in (200, 201):
            return Response(answer["run"], status=answer["status"])
        if answer["status"] == 409:
            raise Conflict(answer["detail"], code="idempotency-conflict")
        if answer["status"] == 503:
            raise ShardUnavailable(answer["detail"])
        if answer["status"] == 400:
            raise ValidationError(answer.get("errors") or {"body": [answer["detail"]]})
        raise NotFound(answer["detail"])


def enqueue_items(
    view: ManageView, request: Request | Call, items: list[Any], size: int, *, full: bool = True
) -> list[run_shape.EnqueueDone | run_shape.EnqueueNamed | run_shape.EnqueueRefused]:
    """Create the runs `items` ask for; one answer per item, in order (the bulk endpoint, and
    the single one as a batch of one). Runs are answered whole, or by id when not `full`.

    1. Validate each item alone: a bad item is a 400 for that item, not for the batch.
    2. Charge the token's enqueue budget for the valid items (429 for all, nothing created).
    3. enqueue_many: one statement for the batch, each item 201, 200, 404 or 409.
    """
    now: datetime | None = None  # read only for an item with runAt; else with the definitions
    answers: list[Any] = [None] * len(items)
    wanted: list[tuple[int, enqueue.Wanted]] = []
    for index, item in enumerate(parse_each(run_shape.EnqueueItem, items, body_size=size)):
        if isinstance(item, run_shape.EnqueueItem) and item.runAt is not None:
            now = now or database_now()
            faults = item.time_problems(now)
            if faults:
                item = ValidationError(faults)
        if not isinstance(item, run_shape.EnqueueItem):
            answers[index] = refused_item(item)
            continue
        wanted.append(
            (
                index,
                enqueue.Wanted(
                    item.job,
                    item.idempotencyKey,
                    item.delaySeconds,
                    item.runAt,
                    item.payload,
                    PRIORITIES[item.priority] if item.priority else None,
                    item.concurrencyKey,
                ),
            )
        )
    refund = charge_enqueue(request.auth, len(wanted))
    # One clock for the request: what the items were checked against is what their delays
    # count from, and a run due now is shown ready.
    try:
        batch = enqueue.enqueue_many(
            view.team_ids(request), [w for _, w in wanted], view.actor(request), now=now, full=full
        )
    except BaseException:
        # Raised, it created nothing (runs committed before a failure are answered, not
        # raised): the whole charge is given back, or the client's retry of a 503 was a 429.
        refund(len(wanted))
        raise
    for (index, _), result in zip(wanted, batch.answers, strict=True):
        if result.status in (200, 201) and not full:
            answers[index] = run_shape.EnqueueNamed(status=result.status, runId=result.run.run_id)
        elif result.status in (200, 201):
            answers[index] = run_shape.EnqueueDone(
                status=result.status, run=run_json(result.run, batch.now)
            )
        else:
            code = {409: "idempotency-conflict", 503: "shard-unavailable"}.get(result.status)
            answers[index] = problem(result.status, result.detail, code=code)
    refund(sum(1 for result in batch.answers if result.status != 201))
    return answers


def refused_item(exc: ValidationError | PayloadTooLarge) -> run_shape.EnqueueRefused:
    """A bad item's answer: the problem details a single call would have had."""
    if isinstance(exc, PayloadTooLarge):
        return problem(413, str(exc.detail))
    errors = flatten_errors(exc.detail)
    return problem(
        400, f"Invalid input: {', '.join(sorted(errors))}.", code="invalid-input", errors=errors
    )


def _parse_from(raw: str | None) -> datetime:
    if raw is None or raw == "":
        return database_now()
    try:
        # A "+" in a query string arrives as a space.
        value = job_shape.after(raw.replace(" ", "+"))
    except PydanticCustomError as exc:
        raise ValidationError({"from": [str(exc)]}) from None
    assert value is not None
    return value


def whole_number(raw: Any) -> int | None:
    """A JSON integer, or a query string of up to 18 ASCII digits (Python's int() also reads
    " 5", "5_0" and other scripts' digits, and refuses past 4 300 digits), else None."""
    if isinstance(raw, str):
        return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else None
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None


def _parse_count(raw: Any) -> int:
    if raw is None or raw == "":
        return 10
    count = whole_number(raw)
    if count is None or not 1 <= count <= 1000:
        raise ValidationError({"count": ["A whole number from 1 to 1000."]})
    return count


def _preview_query(params: Any) -> tuple[int, datetime]:
    """`count` and `from` of a preview's query string; a 400 names every one that is wrong."""
    errors: dict[str, Any] = {}
    count, after = 10, None
    try:
        count = _parse_count(params.get("count"))
    except ValidationError as exc:
        errors.update(exc.detail)  # type: ignore[arg-type]
    try:
        after = _parse_from(params.get("from"))
    except ValidationError as exc:
        errors.update(exc.detail)  # type: ignore[arg-type]
    if errors or after is None:
        raise ValidationError(errors)
    return count, after


class JobPreviewView(ManageView):
    query = {"GET": doc.PREVIEW_QUERY}

    @extend_schema(
        operation_id="previewJob",
        summary="Preview a job's next fire times",
        description=(
            "The next `count` fire times after `from`, in local time and UTC, with the start "
            "after jitter and a note when a DST change moved or repeated one. "
            "Needs the `manage` scope."
        ),
        tags=["jobs"],
        parameters=[doc.JOB_NAME, *query["GET"]],
        responses=doc.responses({200: job_shape.Preview}, 400, 404),
    )
    def get(self, request: Request, name: str) -> Response:
        definition = self.definition(request, name)
        count, after = _preview_query(request.query_params)
        schedule = sched.parse_schedule(definition.schedule)
        times = sched.saved_preview(definition, schedule, after, count)
        return Response(preview_json(times))


class PreviewView(ManageView):
    """Preview a schedule that is not saved (the edit form's live preview)."""

    @extend_schema(
        operation_id="previewSchedule",
        summary="Preview a schedule that is not saved",
        description=(
            "The next `count` fire times of `schedule` after `from`, as for a saved job; "
            "`name` sets the jitter. Needs the `manage` scope."
        ),
        tags=["jobs"],
        request=job_shape.SchedulePreview,
        responses=doc.responses({200: job_shape.Preview}, *doc.BODY_PROBLEMS),
    )
    def post(self, request: Request) -> Response:
        body = self.body(request, job_shape.SchedulePreview)
        after = body.after or database_now()
        schedule = sched.parse_schedule(body.schedule)
        times = sched.preview(body.name, schedule, after, body.count)
        return Response(preview_json(times))


def preview_json(times: list[dict[str, str]]) -> job_shape.Preview:
    return job_shape.Preview(
        times=[
            job_shape.FireTime(
                local=time["local"], utc=time["utc"], start=time["start"], note=time["note"]
            )
            for time in times
        ]
    )


# --- runs ---------------------------------------------------------------------------------


def run_filter(
    team_ids: list[int], params: Any, branches: list[runlist.Branch]
) -> runlist.RunFilter:
    """The runs filters of the query string (`state`, `job`, `queue`, `since`) over the
    `branches` a list shows by default."""
    errors: dict[str, list[str]] = {}
    state = params.get("state")
    if state:
        if state in State.values:
            branches = runlist.REPORTED_TO_STORED[state]
        else:
            errors["state"] = [f"One of {', '.join(State.values)}."]
    # The name rules of definitions and leases (PostgreSQL text cannot hold the NUL some
    # carry): a name no job or queue can have is a mistake to report, not an empty page.
    for key, problem_of in (("job", limits.job_name_problem), ("queue", limits.queue_name_problem)):
        if params.get(key) and (reason := problem_of(params[key])) is not None:
            errors[key] = [reason]
    since = None
    if params.get("since"):
        since = filters.parse_instant(str(params["since"]))
        if since is None:
            errors["since"] = [filters.ISO_RULE]
    if errors:
        raise ValidationError(errors)
    return runlist.RunFilter(
        team_ids=team_ids,
        branches=list(branches),
        queue=params.get("queue") or "",
        job=params.get("job") or "",
        created_from=since,
    )


def page_limit(request: Request) -> int:
    """A list's `?limit=` (1–PAGE_MAX, default PAGE_DEFAULT of apps/runs/limits.py); a 400
    otherwise."""
    limit = whole_number(request.query_params.get("limit") or limits.PAGE_DEFAULT)
    if limit is None or not 1 <= limit <= limits.PAGE_MAX:
        raise ValidationError({"limit": [f"A whole number from 1 to {limits.PAGE_MAX}."]})
    return limit


def next_page(request: Request, cursor: str) -> str:
    """The address of a list's next page: the same query, its `cursor` where this page ended."""
    query = request.query_params.copy()
    query["cursor"] = cursor
    return request.build_absolute_uri(f"{request.path}?{query.urlencode()}")


def run_list(request: Request, flt: runlist.RunFilter, now: datetime) -> Response:
    """Keyset pagination, newest first: `?cursor=<last runId>&limit=N`; no COUNT(*)."""
    limit = page_limit(request)
    before = None
    cursor = request.query_params.get("cursor")
    if cursor:
        before = parse_run_id(cursor)
        if before is None:
            raise ValidationError({"cursor": ["Not a cursor from a previous page."]})
    page = runlist.run_page(flt, now, before=before, limit=limit)
    next_url = None
    if page.next_cursor is not None:
        # The page's last id, not its last run: every run of the page may be gone by the time
        # their rows are read (retention, a job's delete), and the walk goes on below them.
        next_url = next_page(request, public_run_id(page.next_cursor))
    answer = run_shape.RunPage(results=[run_json(run, now) for run in page.runs], next=next_url)
    if page.unavailable:
        answer["unavailableShards"] = page.unavailable
    return Response(answer)


class RunsView(FastPathView, ManageView):
    """The run list (DRF's dispatch) and the bulk enqueue, whose plain JSON POSTs take the
    workers' fast path (apps/api/fastpath.py): an application enqueueing one run a request
    pays for the enqueue, not for DRF's objects."""

    enqueue_methods = ("POST",)
    # Each item is answered on its own, one holding a value no body may hold too (parsers.py).
    body_items = "runs"
    query = {"GET": [doc.RUN_STATE, *doc.RUN_FILTERS]}

    def answer(self, call: Call) -> run_shape.EnqueueAnswer:
        size = body_size(call.request)
        body = parse(run_shape.EnqueueBatch, call.data, body_size=size)
        # RFC 7240: a producer that keeps no runs asks for their ids alone, which spares both
        # sides the rendering and reading of every run (at 1 000 runs a request, a third of
        # the web process's CPU: bench/README.md, "Enqueue").
        full = not wants_minimal(call.request)
        if not full:
            call.headers["Preference-Applied"] = "return=minimal"
        return run_shape.EnqueueAnswer(runs=enqueue_items(self, call, body.runs, size, full=full))

    @extend_schema(
        operation_id="listRuns",
        summary="List runs",
        description=(
            "The team's runs, newest first, filtered by the query; follow `next` for the "
            "next page. Needs the `manage` scope."
        ),
        tags=["runs"],
        parameters=query["GET"],
        responses=doc.responses({200: run_shape.RunPage}, 400),
    )
    def get(self, request: Request) -> Response:
        now = database_now()
        flt = run_filter(self.team_ids(request), request.query_params, runlist.ALL_STORED)
        return run_list(request, flt, now)

    @extend_schema(
        operation_id="enqueueRuns",
        summary="Create runs in bulk",
        description=(
            "Create up to SCHEDULER_MAX_ENQUEUE runs of any jobs of the token's team in one "
            "request: each item is answered on its own, in order (201 created, 200 the run its "
            "idempotency key already names, 400 a bad item, 404 no such job, 409 the key names "
            "a run with another payload). One statement and one NOTIFY per queue for the batch. "
            "Limited per run created (SCHEDULER_API_RATE_ENQUEUE). Needs the `manage` scope."
        ),
        tags=["runs"],
        parameters=[
            OpenApiParameter(
                "Prefer",
                str,
                OpenApiParameter.HEADER,
                description=(
                    "`return=minimal`: answer each created or existing run by its `runId` "
                    "alone (the answer then carries `Preference-Applied: return=minimal`)."
                ),
            )
        ],
        request=run_shape.EnqueueBatch,
        responses=doc.responses({200: run_shape.EnqueueAnswer}, *doc.BODY_PROBLEMS),
    )
    def post(self, request: Request) -> Response:
        call = Call.of(request)
        return Response(self.answer(call), headers=call.headers)


def wants_minimal(request: HttpRequest) -> bool:
    """Whether the request says `Prefer: return=minimal` (among other preferences or not)."""
    prefer = request.META.get("HTTP_PREFER", "")
    return any(
        part.strip().lower() == "return=minimal"
        for preference in prefer.split(",")
        for part in preference.split(";")[:1]
    )


class RunDetailView(ManageView):
    @extend_schema(
        operation_id="getRun",
        summary="Get a run with its attempts",
        description="Needs the `manage` scope.",
        tags=["runs"],
        parameters=[doc.RUN_ID],
        responses=doc.responses({200: run_shape.RunDetail}, 404),
    )
    def get(self, request: Request, run_id: str) -> Response:
        return Response(run_detail_json(self.run(request, run_id), database_now()))


class RunCancelView(ManageView):
    bodyless = frozenset({"POST"})

    @extend_schema(
        operation_id="cancelRun",
        summary="Cancel a run",
        description=(
            "Cancel a `scheduled`, `ready` or `retrying` run at once (200). A `leased` run is "
            "asked to stop (202, `cancelRequested`): its next heartbeat answers 409 with a "
            "`…/cancelled` problem, and it ends `cancelled` when its worker reports or its lease "
            "expires, never retried. Any other state is a 409. Needs the `manage` scope."
        ),
        tags=["runs"],
        parameters=[doc.RUN_ID],
        request=None,
        responses=doc.responses(
            {200: run_shape.Run, 202: run_shape.Run},
            404,
            409,
            e409="The run is in a state that cannot be cancelled.",
        ),
    )
    def post(self, request: Request, run_id: str) -> Response:
        run = self.run(request, run_id)
        if run.state == State.LEASED and run.cancel_requested:
            return Response(run_json(run, database_now()), status=status.HTTP_202_ACCEPTED)
        try:
            run = transitions.require_one(
                transitions.cancel([run], self.actor(request)), run, "cancel"
            )
        except transitions.TransitionError as exc:
            raise Conflict(str(exc)) from exc
        leased = run.state == State.LEASED
        return Response(
            run_json(run, database_now()),
            status=status.HTTP_202_ACCEPTED if leased else status.HTTP_200_OK,
        )


class RunRetryView(ManageView):
    bodyless = frozenset({"POST"})

    @extend_schema(
        operation_id="retryRun",
        summary="Retry a run now",
        description=(
            "Make a `retrying` run ready now, skipping the rest of its backoff; any other "
            "state is a 409. Needs the `manage` scope."
        ),
        tags=["runs"],
        parameters=[doc.RUN_ID],
        request=None,
        responses=doc.responses(
            {200: run_shape.Run},
            404,
            409,
            e409="The run is in a state that cannot be retried.",
        ),
    )
    def post(self, request: Request, run_id: str) -> Response:
        run = self.run(request, run_id)
        try:
            run = transitions.require_one(
                transitions.retry([run], self.actor(request)), run, "retry"
            )
        except transitions.TransitionError as exc:
            raise Conflict(str(exc)) from exc
        return Response(run_json(run, database_now()))


# --- dead-letter queue ---------------------------------------------------------------------


class DlqView(ManageView):
    # Filtered like the run list, `state` included: the dead runs in that state (`dead`: all
    # of them; any other: none).
    query = {"GET": [doc.RUN_STATE, *doc.RUN_FILTERS]}

    @extend_schema(
        operation_id="listDeadRuns",
        summary="List the dead-letter queue",
        description=(
            "The team's `dead` runs, newest first, filtered like the runs list; follow `next` "
            "for the next page. Needs the `manage` scope."
        ),
        tags=["dlq"],
        parameters=query["GET"],
        responses=doc.responses({200: run_shape.RunPage}, 400),
    )
    def get(self, request: Request) -> Response:
        now = database_now()
        dead = [(State.DEAD.value, None)]
        flt = run_filter(self.team_ids(request), request.query_params, dead)
        flt = replace(flt, branches=[branch for branch in flt.branches if branch in dead])
        return run_list(request, flt, now)


# Runs one requeue or discard takes at most (the answer lists them).
DLQ_ACTION_MAX = 10_000


class DlqActionView(ManageView):
    action_name = "requeue"

    @extend_schema(
        operation_id="requeueDeadRuns",
        summary="Requeue dead runs",
        description=(
            "Make the selected dead runs ready again, each with a fresh attempt budget; runs "
            "that are not dead or not the team's are left out. Needs the `manage` scope."
        ),
        tags=["dlq"],
        request=run_shape.DlqSelection,
        responses=doc.responses(
            {200: run_shape.DlqActionAnswer, 207: run_shape.DlqActionAnswer}, *doc.BODY_PROBLEMS
        ),
    )
    def post(self, request: Request) -> Response:
        body = self.body(request, run_shape.DlqSelection)
        team_ids = self.team_ids(request)
        if body.runIds is not None:
            pks = [pk for pk in map(parse_run_id, body.runIds) if pk is not None]
            asked: dict[str, list[int] | None] = dict(shards.runs_by_database(pks))
        else:
            asked = dict.fromkeys(shards.databases())
        action = transitions.requeue if self.action_name == "requeue" else transitions.discard
        changed: list[Run] = []
        after = 0  # the runs up to this id were selected (a filter's next batch starts above)
        while True:
            wanted = DLQ_ACTION_MAX - len(changed)
            runs, foreign = _dead_selected(asked, team_ids, body, after, wanted)
            for team, run_ids in foreign.items():
                self._deny(request, team, "run", run_ids)
            try:
                changed += action(runs, self.actor(request))
            except transitions.PartlyTransitioned as exc:  # not a 5xx over runs that changed
                done = changed + list(exc.changed)
                return Response(
                    run_shape.DlqActionAnswer(
                        count=len(done),
                        runIds=[run.run_id for run in done],
                        unavailableShards=exc.spans,
                    ),
                    status=status.HTTP_207_MULTI_STATUS,
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                )
            # A filter's runs taken meanwhile by another call (a requeue and a discard of
            # everything at once): the next ones that match, up to the cap. Taken alone, the
            # call that came second answered `count: 0` over thousands still dead.
            if body.runIds is not None or len(runs) < wanted or len(changed) >= DLQ_ACTION_MAX:
                break
            after = runs[-1].pk
        return Response(
            run_shape.DlqActionAnswer(count=len(changed), runIds=[run.run_id for run in changed])
        )


def _dead_selected(
    asked: dict[str, list[int] | None], team_ids: list[int], body: Any, after: int, limit: int
) -> tuple[list[Run], dict[Any, list[str]]]:
    """The team's dead runs a DLQ action names, lowest ids first, above `after`, at most
    `limit`; and the runs of other teams it named, by team. One selection per shard database
    (all of them for a filter, where one that is down makes the request a 503 rather than a
    partial requeue)."""
    runs: list[Run] = []
    foreign: dict[Any, list[str]] = {}
    for alias, ids in asked.items():
        with shards.reaching(alias):
            dead = Run.objects.filter(team_id__in=team_ids, state=State.DEAD, pk__gt=after)
            if ids is None:
                dead = filters.apply(dead, body.filter)
            else:
                dead = dead.filter(pk__in=ids)
                others = Run.objects.filter(pk__in=ids).exclude(team_id__in=team_ids)
                for run in shards.with_teams(others):
                    foreign.setdefault(run.team, []).append(run.run_id)
            runs += shards.with_teams(dead.order_by("pk")[:limit])
    return sorted(runs, key=lambda run: run.pk)[:limit], foreign


@extend_schema_view(
    post=extend_schema(
        operation_id="discardDeadRuns",
        summary="Discard dead runs",
        description=(
            "Take the selected dead runs out of the DLQ (they become `cancelled`, their history "
            "kept); runs that are not dead or not the team's are left out. "
            "Needs the `manage` scope."
        ),
        tags=["dlq"],
        request=run_shape.DlqSelection,
        responses=doc.responses(
            {200: run_shape.DlqActionAnswer, 207: run_shape.DlqActionAnswer}, *doc.BODY_PROBLEMS
        ),
    )
)
class DlqDiscardView(DlqActionView):
    action_name = "discard"
