"""The producer client without I/O: each call as a request to send and a parser of its answer.

`Api`'s methods build `Call`s (or, for `enqueue_many`, a `Plan`: a generator that yields one
call per chunk and receives each answer); `answer` turns a response into a value or the
`ApiError` it stands for; `RetryPolicy` says whether and when to send a call again. The drivers
in client.py (`Client` on httpx.Client, `AsyncClient` on httpx.AsyncClient) only send, sleep and
loop, so both speak the API through this one module.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar, Union
from urllib.parse import parse_qsl, quote, urlsplit

import httpx

from cronlease_client.errors import (
    PROBLEM_TYPES,
    ApiError,
    BadAnswer,
    ChangedMeanwhile,
    NetworkError,
    RateLimited,
    ServerError,
    SyncIncomplete,
    Unavailable,
    error_for,
)
from cronlease_client.models import (
    DlqResult,
    Enqueue,
    EnqueueResult,
    FireTime,
    InvalidItem,
    Job,
    Page,
    Queue,
    Run,
    SyncResult,
)
from cronlease_client.transport import (
    backoff_delay,
    decode,
    encode,
    read_answer,
    retry_after_seconds,
)

T = TypeVar("T")

# The server's default batch limit (SCHEDULER_MAX_ENQUEUE).
MAX_ENQUEUE = 1000
# The largest request body `enqueue_many` sends. The scheduler refuses a body over its payload
# cap + 64 KiB (DATA_UPLOAD_MAX_MEMORY_SIZE: 1 MiB + 64 KiB by default), a client cannot know
# a server's setting, and nginx in front of one refuses over 1 MiB by default
# (client_max_body_size): 1 MiB stays under both.
MAX_BODY_BYTES = 1024 * 1024
# Gateway errors: the request may or may not have been handled, so only idempotent calls retry.
GATEWAY_ERRORS = (502, 504)


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its answer. `idempotent`: sending it twice does what sending
    it once does, so a retry after an answer was lost is safe."""

    method: str
    path: str
    parse: Callable[[Any], T]
    body: Any = None
    params: Mapping[str, Any] | None = None
    idempotent: bool = False
    headers: Mapping[str, str] | None = None
    # `body` already encoded: a bulk enqueue encodes each item to measure it, once.
    content: bytes | None = None
    # The answer is a job: its ETag is its `version`.
    versioned: bool = False
    # A delete: a 404 to a try after one whose answer was lost means that one deleted it.
    gone_is_done: bool = False

    def request(self) -> dict[str, Any]:
        """The keyword arguments of httpx's `request` for this call."""
        headers = dict(self.headers or {})
        content = self.content
        if content is None and self.body is not None:
            content = encode(self.body)
        if content is not None:
            headers["Content-Type"] = "application/json"
        return {
            "method": self.method,
            "url": self.path,
            "params": {k: v for k, v in (self.params or {}).items() if v is not None},
            "content": content,
            "headers": headers or None,
        }


# An operation of several requests: yields each call, is sent its parsed answer, returns the value.
Plan = Generator[Call[Any], Any, T]
Op = Union[Call[T], Plan[T]]  # noqa: UP007 - a generic alias; `|` cannot be subscripted


def answer(call: Call[T], response: httpx.Response) -> T:
    """The value of `call`'s answer; raise the ApiError it stands for (BadAnswer for a success
    status whose body is not JSON, or that `call.parse` refuses as not of its shape)."""
    if response.status_code >= 400:
        raise response_error(response)
    if response.status_code == 204:  # no content: a delete
        return None  # type: ignore[return-value]
    value: Any = read_answer(response.status_code, response.content, call.parse)
    if call.versioned:
        value = replace(value, version=response.headers.get("ETag", ""))
    return value


def response_error(response: httpx.Response) -> ApiError:
    try:
        problem = decode(response.content)
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        problem = {}
    detail = str(
        problem.get("detail")
        or problem.get("title")
        or response.text[:500]
        or response.reason_phrase
    )
    wait = retry_after_seconds(response.headers.get("Retry-After"))
    error = error_for(response.status_code, problem, detail=detail, retry_after=wait)
    if isinstance(error, ChangedMeanwhile):
        error.version = response.headers.get("ETag", "")
    return error


def network_error(exc: httpx.TransportError) -> NetworkError:
    # These fail before the request is written: nothing reached the scheduler.
    unsent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)
    return NetworkError(f"{type(exc).__name__}: {exc}", sent=not unsent)


@dataclass(frozen=True)
class RetryPolicy:
    """Which failures are tried again, how often and after how long.

    1. 429 and 503 always: the scheduler did nothing. It says how long to wait in Retry-After;
       without one, the wait is a capped, jittered exponential backoff.
    2. A failed connection always (the request never left); a lost answer, a 502 or 504 from
       a gateway, or a success answer garbled on its way (BadAnswer), only for idempotent calls.
    3. At most `retries` times; a Retry-After longer than `max_wait` is not waited out, and
       the error (RateLimited or Unavailable, with `retry_after`) is raised at once.
    """

    retries: int = 3
    backoff_base: float = 0.5
    backoff_cap: float = 10.0
    max_wait: float = 60.0

    def wait(self, call: Call[Any], error: ApiError, failures: int) -> float | None:
        """The seconds to wait before sending `call` again after its `failures`-th failure,
        or None to raise `error`."""
        if failures > self.retries:
            return None
        if isinstance(error, RateLimited | Unavailable):
            if error.retry_after:  # 0 says nothing: back off as without one
                return error.retry_after if error.retry_after <= self.max_wait else None
        elif isinstance(error, NetworkError):
            if error.sent and not call.idempotent:
                return None
        elif isinstance(error, BadAnswer):
            # The call was made and its answer lost on the way, as with a lost connection.
            if not call.idempotent:
                return None
        elif isinstance(error, SyncIncomplete):
            pass  # made in part: the same call makes the rest (it is idempotent)
        elif not (
            isinstance(error, ServerError) and error.status in GATEWAY_ERRORS and call.idempotent
        ):
            return None
        return backoff_delay(failures, base=self.backoff_base, cap=self.backoff_cap)


def next_page(call: Call[Page[T]], page: Page[T]) -> Call[Page[T]] | None:
    """The call for the page after `page`: the same path with the query of its `next` link
    (followed by its query only, so a proxy in front of the scheduler does not matter)."""
    if not page.next:
        return None
    return replace(call, params=dict(parse_qsl(urlsplit(page.next).query)))


# --- parsers ---------------------------------------------------------------------------------


# Each raises TypeError (or ValueError) for an answer not of its shape, which `answer` turns
# into BadAnswer; a model's own check is its `parse`.


def _list(parse: Callable[[Any], T], key: str = "results") -> Callable[[Any], list[T]]:
    """A parser of `{key: [item, …]}`: its items, each read with `parse`."""

    def parse_list(data: Any) -> list[T]:
        items = data.get(key) if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise TypeError(f"{key} is not a list")
        return [parse(item) for item in items]

    return parse_list


_runs = _list(Run.parse)


def _runs_page(data: Any) -> Page[Run]:
    items = _runs(data)
    link = data.get("next")
    if link is not None and not isinstance(link, str):
        raise TypeError("next is not a link")
    return Page(items=tuple(items), next=link, raw=data)


# RFC 7240: the bulk enqueue then answers each run by its id alone.
MINIMAL = {"Prefer": "return=minimal"}


def enqueue_result(item: Any, key: str) -> EnqueueResult:
    """One item of a bulk enqueue's answer; TypeError when it is not of its shape."""
    # A JSON object decodes to a dict; isinstance against the Mapping ABC cost a microsecond
    # a run.
    if not isinstance(item, dict):
        raise TypeError("an item of runs is not an object")
    status = item.get("status")
    run = item.get("run")
    if not isinstance(run, dict):
        run = None
    run_id = run.get("runId") if run is not None else item.get("runId")
    if status == 201 or status == 200:
        if not isinstance(run_id, str):
            raise TypeError("an item that names a run has no runId")
        return EnqueueResult(status, key, run_json=run, run_id=run_id)
    if not isinstance(status, int) or status < 400:
        raise TypeError(f"an item's status is {status!r:.20}")
    error = error_for(status, item)
    return EnqueueResult(status, key, error=error, run_json=run, run_id=run_id)


def _enqueue_answer(keys: list[str]) -> Callable[[Any], list[EnqueueResult]]:
    """A parser of `POST /api/v1/runs`'s answer to the items sent with `keys`."""

    def parse(data: Any) -> list[EnqueueResult]:
        items = data.get("runs") if isinstance(data, dict) else None
        if not isinstance(items, list) or len(items) != len(keys):
            raise TypeError(f"runs is not a list of the {len(keys)} items sent")
        return [enqueue_result(item, key) for item, key in zip(items, keys, strict=True)]

    return parse


# The JSON around a bulk enqueue's items (a comma between two more).
_BODY_HEAD, _BODY_TAIL = b'{"runs":[', b"]}"
_FRAME = len(_BODY_HEAD) + len(_BODY_TAIL)
_ENQUEUE_FIELDS = frozenset(Enqueue.__dataclass_fields__)
_TITLES = {400: "Bad request", 413: "Payload too large"}


def _entry(item: Enqueue | Mapping[str, Any]) -> Enqueue:
    """An item of `enqueue_many` as an Enqueue; InvalidItem when it is not one."""
    if isinstance(item, Enqueue):
        return item
    if not isinstance(item, Mapping):
        kind = type(item).__name__
        raise InvalidItem({"item": f"an item is an Enqueue or a dict of its fields, not {kind}"})
    reasons = {
        str(name): f"{name!r} is not a field of Enqueue"
        for name in item
        if name not in _ENQUEUE_FIELDS
    }
    if "job" not in item:
        reasons["job"] = "an item needs its job"
    if reasons:
        raise InvalidItem(reasons)
    return Enqueue(**item)


def _given_key(item: Any) -> Any:
    if isinstance(item, Enqueue):
        return item.idempotency_key
    return item.get("idempotency_key") if isinstance(item, Mapping) else None


def _encoded(item: Mapping[str, Any]) -> bytes:
    """An item's JSON; ValueError for NaN or Infinity, which orjson writes as null where the
    scheduler refuses them (not JSON): only a text with a null is encoded again to tell."""
    try:
        content = encode(item)
        if b"null" in content:
            json.dumps(item, allow_nan=False)
    except RecursionError:  # the standard library's encoder, past orjson's 255 levels
        raise ValueError("nested too deeply to be sent as JSON") from None
    return content


def _sendable(body: Any) -> bytes:
    """A body's JSON; ValueError for what JSON cannot hold (NaN, a set), which the encoder would
    otherwise have written as null, or failed on as a TypeError."""
    try:
        return _encoded(body)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the body cannot be sent as JSON: {exc}") from None


def _unencodable(item: Mapping[str, Any]) -> str:
    """The field of an item's JSON that cannot be encoded (looked for once encoding failed)."""
    for name, value in item.items():
        try:
            _encoded({name: value})
        except (TypeError, ValueError):
            return _FIELD_NAMES.get(name, name)
    return "item"


# An item's JSON keys by the argument that sets them, to name the argument in a refusal.
_FIELD_NAMES = {
    "job": "job",
    "payload": "payload",
    "idempotencyKey": "idempotency_key",
    "delaySeconds": "delay",
    "runAt": "run_at",
    "priority": "priority",
    "concurrencyKey": "concurrency_key",
}


def _refused(
    key: str, status: int, code: str, detail: str, errors: dict[str, list[str]] | None = None
) -> EnqueueResult:
    """An item the client answers itself, as the scheduler answers an item it refuses."""
    return EnqueueResult(status, key, error=_refusal(status, code, detail, errors))


def _refusal(
    status: int, code: str, detail: str, errors: dict[str, list[str]] | None = None
) -> ApiError:
    """The error the scheduler would answer for an item the client refuses itself."""
    problem: dict[str, Any] = {
        "type": PROBLEM_TYPES + code,
        "title": _TITLES[status],
        "status": status,
        "detail": detail,
    }
    if errors:
        problem["errors"] = errors
    return error_for(status, problem)


def _first_run(results: list[EnqueueResult]) -> Run:
    (result,) = results
    if result.error is not None:
        raise result.error
    assert result.run is not None
    return result.run


# --- the calls -------------------------------------------------------------------------------


def _name(name: str) -> str:
    # "." and ".." are path segments to a URL: httpx removes them, and put_job(".", …) was a
    # PUT of /api/v1/jobs, the jobs-as-code sync. No job, run or queue has either name.
    if name in (".", ".."):
        raise ValueError(f"{name!r} names no job, run or queue")
    return quote(name, safe="")


def _instant(value: datetime | str | None, what: str) -> str | None:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError(f"{what} must be an aware datetime (with a time zone)")
        return value.isoformat()
    return value


def _preconditions(if_match: str | None, create_only: bool = False) -> dict[str, str] | None:
    """The headers of a change made only to the version read (a retry of it is not idempotent:
    the first may have changed the version, and the retry is then refused)."""
    if create_only:
        if if_match is not None:
            raise ValueError("if_match replaces a job, create_only never does: give one")
        return {"If-None-Match": "*"}
    return {"If-Match": if_match} if if_match is not None else None


def _definition(definition: Mapping[str, Any] | Job) -> dict[str, Any]:
    return dict(definition.raw if isinstance(definition, Job) else definition)


def _dlq_selection(run_ids: Iterable[str] | None, filter: Mapping[str, Any] | None) -> dict:
    if (run_ids is None) == (filter is None):
        raise ValueError("give either run_ids or filter")
    if run_ids is not None:
        return {"runIds": list(run_ids)}
    selection = dict(filter or {})
    if "since" in selection:
        selection["since"] = _instant(selection["since"], "since")
    return {"filter": selection}


class Api:
    """Every call of the producer client, as requests: the drivers send them."""

    def __init__(
        self, *, batch_size: int = MAX_ENQUEUE, max_body_bytes: int = MAX_BODY_BYTES
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        self.batch_size = batch_size
        self.max_body_bytes = max_body_bytes

    @staticmethod
    def new_key() -> str:
        return str(uuid.uuid4())

    # Runs -----------------------------------------------------------------------------------

    def enqueue(
        self,
        job: str,
        *,
        payload: Any = None,
        delay: float | timedelta | None = None,
        run_at: datetime | str | None = None,
        idempotency_key: str | None = None,
        priority: str | None = None,
        concurrency_key: str | None = None,
    ) -> Call[Run]:
        """Create a run of `job` (`POST /api/v1/runs`) and return it.

        `delay` (seconds or a timedelta) or `run_at` (an aware datetime or an ISO string) sets
        when it is due; neither means now. The same `idempotency_key` again returns the run it
        made (with a different payload: IdempotencyConflict). Without a key one is made up, so
        a retry of this request cannot create a second run.
        """
        item = Enqueue(job, payload, delay, run_at, idempotency_key, priority, concurrency_key)
        key = self.new_key() if idempotency_key is None else idempotency_key
        parse = _enqueue_answer([key])
        # Refused as the scheduler's refusal of the item would be, and as enqueue_many answers
        # it: a BadRequest (an ApiError) with the reasons by argument.
        try:
            body = item.to_json(key)
        except InvalidItem as exc:
            raise _refusal(400, "invalid-input", str(exc), exc.errors) from None
        try:
            _encoded(body)
        except (TypeError, ValueError) as exc:
            name = _unencodable(body)
            reason = f"{name} cannot be encoded as JSON: {exc}"
            raise _refusal(400, "invalid-input", reason, {name: [reason]}) from None
        return Call(
            "POST",
            "/api/v1/runs",
            lambda data: _first_run(parse(data)),
            {"runs": [body]},
            idempotent=True,
        )

    def enqueue_many(
        self, items: Iterable[Enqueue | Mapping[str, Any]], *, runs: bool = True
    ) -> Plan[list[EnqueueResult]]:
        """Create many runs and return a result per item, in order.

        An item is an `Enqueue` or a dict of its fields (`{"job": …, "delay": 60}`). A request
        carries up to `batch_size` items and `max_body_bytes` of JSON. An item the scheduler
        refuses (400, 404, 409, 413) has its `error` in its result, and so has one the client
        refuses itself: 400 (`invalid-input`, `errors` by argument) for an unknown field or a
        bad `delay`/`run_at`, 413 for an item larger alone than `max_body_bytes`. Only a
        failure of a whole request raises, with the results of the batches before it as
        `error.enqueued`. With `runs=False` the scheduler answers each run by its id alone
        (`result.run_id`; `result.run` is None): a third less CPU per run for a producer that
        keeps no runs.
        """
        sent: list[tuple[str, bytes]] = []
        # Items refused here, by their place: answered as the scheduler answers a bad item, not
        # raised, so the others are still sent.
        refused: dict[int, EnqueueResult] = {}
        largest = self.max_body_bytes - _FRAME
        for index, item in enumerate(items):
            given = _given_key(item)
            key = self.new_key() if given is None else given
            try:
                body = _entry(item).to_json(key)
            except InvalidItem as exc:
                refused[index] = _refused(key, 400, "invalid-input", str(exc), exc.errors)
                continue
            try:
                # Each item encoded alone, to cut the batches by size; they are sent as is.
                content = _encoded(body)
            except (TypeError, ValueError) as exc:
                name = _unencodable(body)
                reason = f"{name} cannot be encoded as JSON: {exc}"
                refused[index] = _refused(key, 400, "invalid-input", reason, {name: [reason]})
                continue
            if len(content) > largest:
                detail = (
                    f"The item is {len(content)} bytes of JSON: a request of it alone would be "
                    f"over the client's max_body_bytes ({self.max_body_bytes})."
                )
                refused[index] = _refused(key, 413, "payload-too-large", detail)
                continue
            sent.append((key, content))
        return self._enqueue_batches(sent, None if runs else MINIMAL, refused)

    def _batches(self, items: list[tuple[str, bytes]]) -> Iterable[list[tuple[str, bytes]]]:
        """`items` cut in runs of at most `batch_size` items and `max_body_bytes` of body
        (every item fits alone: `enqueue_many` refused the others)."""
        batch: list[tuple[str, bytes]] = []
        size = _FRAME
        for item in items:
            grown = size + len(item[1]) + (1 if batch else 0)  # the comma before it
            if batch and (len(batch) == self.batch_size or grown > self.max_body_bytes):
                yield batch
                batch, grown = [], _FRAME + len(item[1])
            batch.append(item)
            size = grown
        if batch:
            yield batch

    def _enqueue_batches(
        self,
        items: list[tuple[str, bytes]],
        headers: Mapping[str, str] | None,
        refused: Mapping[int, EnqueueResult],
    ) -> Plan[list[EnqueueResult]]:
        """Send `items` (key, encoded item) in batches; the results in order, `refused` put
        back in their places."""

        def in_order(sent: list[EnqueueResult]) -> list[EnqueueResult]:
            if not refused:
                return sent
            answers, merged = iter(sent), []
            for index in range(len(sent) + len(refused)):
                merged.append(refused[index] if index in refused else next(answers, None))
            return [result for result in merged if result is not None]

        results: list[EnqueueResult] = []
        pending = list(self._batches(items))
        while pending:
            batch = pending.pop(0)
            content = _BODY_HEAD + b",".join(item for _, item in batch) + _BODY_TAIL
            try:
                answers = yield Call(
                    "POST",
                    "/api/v1/runs",
                    _enqueue_answer([key for key, _ in batch]),
                    idempotent=True,  # every item has its key
                    headers=headers,
                    content=content,
                )
            except ApiError as error:
                if error.type.endswith("/batch-over-rate") and len(batch) > 1:
                    # More runs than the token may create in a whole period: in halves.
                    half = len(batch) // 2
                    pending[:0] = [batch[:half], batch[half:]]
                    continue
                # The batches before this one were created: say which, so nothing is lost.
                error.enqueued = in_order(results)
                raise
            results += answers
        return in_order(results)

    def get_run(self, run_id: str) -> Call[Run]:
        """The run with its attempts (`Run.attempts`, oldest first)."""
        return Call("GET", f"/api/v1/runs/{_name(run_id)}", Run.parse, idempotent=True)

    def runs(
        self,
        *,
        state: str | None = None,
        job: str | None = None,
        queue: str | None = None,
        since: datetime | str | None = None,
        page_size: int = 50,
    ) -> Call[Page[Run]]:
        """The team's runs, newest first, every page (`page_size` runs a request)."""
        params = {
            "state": state,
            "job": job,
            "queue": queue,
            "since": _instant(since, "since"),
            "limit": page_size,
        }
        return Call("GET", "/api/v1/runs", _runs_page, params=params, idempotent=True)

    def cancel_run(self, run_id: str) -> Call[Run]:
        """Cancel a scheduled, ready or retrying run (a leased one: when its worker reports)."""
        return Call("POST", f"/api/v1/runs/{_name(run_id)}/cancel", Run.parse)

    def retry_run(self, run_id: str) -> Call[Run]:
        """Make a retrying run ready now."""
        return Call("POST", f"/api/v1/runs/{_name(run_id)}/retry", Run.parse)

    # Dead-letter queue -----------------------------------------------------------------------

    def dlq(
        self,
        *,
        job: str | None = None,
        queue: str | None = None,
        since: datetime | str | None = None,
        page_size: int = 50,
    ) -> Call[Page[Run]]:
        """The team's dead runs, newest first, every page."""
        params = {"job": job, "queue": queue, "since": _instant(since, "since"), "limit": page_size}
        return Call("GET", "/api/v1/dlq", _runs_page, params=params, idempotent=True)

    def requeue(
        self, run_ids: Iterable[str] | None = None, *, filter: Mapping[str, Any] | None = None
    ) -> Call[DlqResult]:
        """Make dead runs ready again, by id or by `filter` (`{"job", "queue", "since"}`, or
        `{"all": True}`)."""
        body = _dlq_selection(run_ids, filter)
        return Call("POST", "/api/v1/dlq/requeue", DlqResult.parse, body)

    def discard(
        self, run_ids: Iterable[str] | None = None, *, filter: Mapping[str, Any] | None = None
    ) -> Call[DlqResult]:
        """Take dead runs out of the DLQ (they become cancelled), by id or by `filter`."""
        body = _dlq_selection(run_ids, filter)
        return Call("POST", "/api/v1/dlq/discard", DlqResult.parse, body)

    # Jobs -----------------------------------------------------------------------------------

    def get_job(self, name: str) -> Call[Job]:
        return Call(
            "GET", f"/api/v1/jobs/{_name(name)}", Job.parse, idempotent=True, versioned=True
        )

    def list_jobs(self) -> Call[list[Job]]:
        """The team's job definitions, by name."""
        return Call("GET", "/api/v1/jobs", _list(Job.parse), idempotent=True)

    def put_job(
        self,
        name: str,
        definition: Mapping[str, Any] | Job,
        *,
        if_match: str | None = None,
        create_only: bool = False,
    ) -> Call[Job]:
        """Create or replace the definition `name` (it states at least its `queue`; `paused`
        and `dryRun` left out keep what the job has). `if_match` (a job's `version`): replace
        only the job at that version; `create_only`: never replace. Either raises
        ChangedMeanwhile when it does not hold, and nothing is changed."""
        return Call(
            "PUT",
            f"/api/v1/jobs/{_name(name)}",
            Job.parse,
            content=_sendable(_definition(definition)),
            headers=_preconditions(if_match, create_only),
            idempotent=if_match is None and not create_only,
            versioned=True,
        )

    def apply_jobs(
        self,
        jobs: Iterable[Mapping[str, Any] | Job],
        *,
        prune: bool = False,
        dry_run: bool = False,
    ) -> Call[SyncResult]:
        """Make the team's definitions these (jobs as code): create and update them, and with
        `prune` delete the others. `dry_run` answers the changes and makes none."""
        body = {"jobs": [_definition(job) for job in jobs], "prune": prune, "dryRun": dry_run}
        return Call("PUT", "/api/v1/jobs", _complete_sync, content=_sendable(body), idempotent=True)

    def pause_job(self, name: str, *, if_match: str | None = None) -> Call[Job]:
        return self._job_action(name, "pause", if_match)

    def resume_job(self, name: str, *, if_match: str | None = None) -> Call[Job]:
        return self._job_action(name, "resume", if_match)

    def _job_action(self, name: str, action: str, if_match: str | None) -> Call[Job]:
        return Call(
            "POST",
            f"/api/v1/jobs/{_name(name)}/{action}",
            Job.parse,
            headers=_preconditions(if_match),
            idempotent=if_match is None,
            versioned=True,
        )

    def delete_job(self, name: str, *, if_match: str | None = None) -> Call[None]:
        """Delete the job with its runs (`if_match`: only at that version)."""
        return Call(
            "DELETE",
            f"/api/v1/jobs/{_name(name)}",
            lambda _: None,
            headers=_preconditions(if_match),
            idempotent=if_match is None,
            gone_is_done=True,
        )

    def trigger_job(self, name: str) -> Call[Run]:
        """Create a run of the job due now."""
        return Call("POST", f"/api/v1/jobs/{_name(name)}/trigger", Run.parse)

    def preview(
        self, name: str, count: int = 10, from_: datetime | str | None = None
    ) -> Call[list[FireTime]]:
        """The job's next `count` fire times after `from_` (default now)."""
        params = {"count": count, "from": _instant(from_, "from_")}
        return Call(
            "GET",
            f"/api/v1/jobs/{_name(name)}/preview",
            _list(FireTime.parse, "times"),
            params=params,
            idempotent=True,
        )

    # Queues ---------------------------------------------------------------------------------

    def queues(self) -> Call[list[Queue]]:
        """The team's queues with their depth by priority."""
        return Call("GET", "/api/v1/queues", _list(Queue.parse), idempotent=True)

    def pause_queue(self, name: str) -> Call[Queue]:
        """Stop the queue's runs from being leased (runs keep being created)."""
        path = f"/api/v1/queues/{_name(name)}/pause"
        return Call("POST", path, Queue.parse, idempotent=True)

    def resume_queue(self, name: str) -> Call[Queue]:
        path = f"/api/v1/queues/{_name(name)}/resume"
        return Call("POST", path, Queue.parse, idempotent=True)

    def set_queue_rate_limit(
        self, name: str, count: int | None, period_seconds: int | None = None
    ) -> Call[Queue]:
        """Let at most `count` leases start from the queue, all its jobs together, in any
        window of `period_seconds` (on top of each job's own limit); `count=None` lifts the
        limit. Its pause is left as it is."""
        if (count is None) != (period_seconds is None):
            raise ValueError("give count and period_seconds, or neither to lift the limit")
        limit = None if count is None else {"count": count, "periodSeconds": period_seconds}
        path = f"/api/v1/queues/{_name(name)}"
        return Call("PUT", path, Queue.parse, {"rateLimit": limit}, idempotent=True)


def _complete_sync(answer: Any) -> SyncResult:
    """A sync's answer; SyncIncomplete (retried, as the call is idempotent) when a database
    failed at its commit after others had committed."""
    result = SyncResult.parse(answer)
    if not result.complete:
        raise SyncIncomplete(result)
    return result
