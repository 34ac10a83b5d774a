"""Handlers by job name: the module-level `@handler` decorator and the loader the CLI uses."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from cronlease_client.context import Context

HandlerFunc = Callable[[Context], Any]
F = TypeVar("F", bound=HandlerFunc)

# The attribute a decorated function carries, so a dict of such functions keeps their options.
SPEC_ATTRIBUTE = "__cronlease_handler__"
# The scheduler's rule for job names (apps/runs/limits.py). A worker names its handlers' jobs in
# every lease request, so one that is not a job's name would get every request refused.
JOB_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)*$")
JOB_NAME_MAX = 200


def job_name_problem(job: object) -> str | None:
    """Why `job` cannot be a job's name, or None when it can."""
    if not isinstance(job, str) or not JOB_NAME_RE.match(job) or len(job) > JOB_NAME_MAX:
        return (
            f"use at most {JOB_NAME_MAX} lowercase dotted words of letters, digits, '-' and "
            "'_', e.g. 'billing.export-invoices'"
        )
    return None


@dataclass(frozen=True)
class HandlerSpec:
    """A handler and its options. `dry_run`: the handler runs for dry-run runs too (opt-in)."""

    job: str
    func: HandlerFunc
    dry_run: bool = False


_registry: dict[str, HandlerSpec] = {}


def _same_function(a: HandlerFunc, b: HandlerFunc) -> bool:
    # A reloaded module defines new function objects under the same names: not a conflict.
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


def spec_for(
    job: str, func: HandlerFunc | HandlerSpec, *, dry_run: bool | None = None
) -> HandlerSpec:
    """Return the HandlerSpec of `func` for `job`, keeping options set by `@handler`."""
    if isinstance(func, HandlerSpec):
        base = func.func
        flag = func.dry_run
    else:
        if not callable(func):
            raise TypeError(f"the handler of {job!r} is not callable: {func!r}")
        base = func
        existing = getattr(func, SPEC_ATTRIBUTE, None)
        flag = existing.dry_run if isinstance(existing, HandlerSpec) else False
    return HandlerSpec(job, base, flag if dry_run is None else dry_run)


def handler(job: str, *, dry_run: bool = False) -> Callable[[F], F]:
    """Register the decorated function as the handler of `job` in the module-level registry.

    `dry_run=True` opts in to being called for dry-run runs (with `ctx.dry_run` true); without
    it the worker skips dry-run runs and completes them as `{"dryRun": true, "skipped": true}`.
    """

    def register(func: F) -> F:
        existing = _registry.get(job)
        if existing is not None and not _same_function(existing.func, func):
            raise ValueError(
                f"job {job!r} already has a handler: "
                f"{existing.func.__module__}.{existing.func.__qualname__}"
            )
        spec = HandlerSpec(job, func, dry_run)
        _registry[job] = spec
        setattr(func, SPEC_ATTRIBUTE, spec)
        return func

    return register


def registered_handlers() -> dict[str, HandlerSpec]:
    """Return a copy of the module-level registry (every `@handler` imported so far)."""
    return dict(_registry)


def load_handlers(module_name: str) -> dict[str, HandlerSpec]:
    """Import `module_name`; return its `HANDLERS` dict merged with every `@handler` registered.

    The whole registry counts, not only the module's own functions, so an entry module may import
    the modules that hold the handlers.
    """
    module = importlib.import_module(module_name)
    found = registered_handlers()
    table: Mapping[str, Any] = getattr(module, "HANDLERS", None) or {}
    if not isinstance(table, Mapping):
        raise TypeError(f"{module_name}.HANDLERS must be a dict of job name to function")
    for job, func in table.items():
        spec = spec_for(job, func)
        if job in found and not _same_function(found[job].func, spec.func):
            raise ValueError(f"job {job!r} has two handlers: in HANDLERS and in @handler")
        found[job] = spec
    return found
