"""Exceptions: the ones handlers raise to steer retries, and the ones the SDK raises to callers."""

from __future__ import annotations

from typing import Any

# The base of the scheduler's problem types (`…/problems/invalid-input`). The client's own
# refusals of an `enqueue_many` item use it too, so they read as the scheduler's.
PROBLEM_TYPES = "https://docs.cronlease.dev/problems/"


class HandlerError(Exception):
    """Base of the exceptions a handler raises to say whether its run may be retried.

    `error_type` names the error on the run (its `lastError.type`); by default it is the type of
    the exception this one was raised from (`raise NonRetryable("bad row") from exc`), or the
    class name.
    """

    retryable: bool = True

    def __init__(self, message: str = "", *, error_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep error_type when the exception travels back from a process-pool child.
        return (_rebuild, (type(self), self.message, self.error_type))


def _rebuild(cls: type[HandlerError], message: str, error_type: str | None) -> HandlerError:
    return cls(message, error_type=error_type)


class Retryable(HandlerError):
    """Fail this attempt; the scheduler retries the run while it has attempts left."""

    retryable = True


class NonRetryable(HandlerError):
    """Fail the run for good: it goes to the dead-letter queue whatever attempts are left."""

    retryable = False


class RunCancelled(HandlerError):
    """Raised by `ctx.heartbeat()` once someone cancelled the run: the handler stops, the
    worker reports it, and the run ends `cancelled` (never retried)."""

    retryable = False

    def __init__(self, message: str = "the run was cancelled", *, error_type: str | None = None):
        super().__init__(message, error_type=error_type or "RunCancelled")


class LeaseLost(HandlerError):
    """Raised by `ctx.heartbeat()` once the lease is gone (taken over, expired, or the worker is
    shutting down): the result would not be sent, so the handler should stop."""

    def __init__(self, message: str = "the lease was lost", *, error_type: str | None = None):
        super().__init__(message, error_type=error_type or "LeaseLost")


class ApiError(Exception):
    """The scheduler answered with an error, or could not be reached (`status` None).

    `problem` is the answer's problem details (`type`, `title`, `status`, `detail`, `errors`);
    the subclasses below name each kind, chosen by `error_for`.
    """

    # Set when `enqueue_many` fails part way: the results of the batches created before.
    enqueued: list[Any] | None = None

    def __init__(
        self, status: int | None, detail: str, *, problem: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{status or 'network error'}: {detail}")
        self.status = status
        self.detail = detail
        self.problem = problem or {}

    @property
    def type(self) -> str:
        """The problem type, a URL ending in a slug (`…/problems/idempotency-conflict`)."""
        return str(self.problem.get("type") or "")

    @property
    def title(self) -> str:
        return str(self.problem.get("title") or "")

    @property
    def errors(self) -> dict[str, list[str]]:
        """Reasons by field (`retry.maxAttempts`, `runs[3].runAt`); empty unless a 400."""
        errors = self.problem.get("errors")
        return errors if isinstance(errors, dict) else {}

    @property
    def transient(self) -> bool:
        """Whether trying again later may succeed: no answer, throttled, or a server error."""
        return self.status is None or self.status == 429 or self.status >= 500


class SyncIncomplete(ApiError):
    """207 to `apply_jobs`: a database of the scheduler failed at its commit after others had
    committed; `result` says which changes were made. The same call again makes the rest, so it
    is retried as a 503 is."""

    def __init__(self, result: Any) -> None:
        super().__init__(207, result.detail or "some changes were not made")
        self.result = result

    @property
    def transient(self) -> bool:
        return True


class BadAnswer(ApiError):
    """A success status whose body is not the answer the call expects: not JSON, cut short, an
    HTML page, or JSON of another shape. Something between the worker and the scheduler (a proxy,
    a load balancer) or the scheduler itself failed, as with a 5xx: trying again may succeed."""

    @property
    def transient(self) -> bool:
        return True


class NetworkError(ApiError):
    """No answer: the connection failed or timed out. `sent` is False when the request surely
    never reached the scheduler (it could not connect), so even a call that is not idempotent
    may be sent again."""

    def __init__(self, detail: str, *, sent: bool = True) -> None:
        super().__init__(None, detail)
        self.sent = sent


class BadRequest(ApiError):
    """400: the input is invalid; `errors` has every field's reasons."""


class Unauthorized(ApiError):
    """401: no token, or one the scheduler does not know (revoked, mistyped)."""


class Forbidden(ApiError):
    """403: the token lacks the scope, or the name belongs to another team."""


class NotFound(ApiError):
    """404: no such job or run for this token's team."""


class Conflict(ApiError):
    """409: the state does not allow the change (a run that cannot be cancelled, a stale token)."""


class IdempotencyConflict(Conflict):
    """409: the idempotency key is taken by a run with another payload."""


class ChangedMeanwhile(ApiError):
    """412: the job is not at the version `if_match` named (someone changed it since it was
    read), or exists though `create_only` was asked; nothing was changed. `version` is its
    version now."""

    version: str = ""


class PayloadTooLarge(ApiError):
    """413: the payload, or the whole body, is over the scheduler's limit."""


class _AsksToWait(ApiError):
    """An answer that may say how long to wait before asking again (`Retry-After`)."""

    def __init__(
        self,
        status: int | None,
        detail: str,
        *,
        problem: dict[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, detail, problem=problem)
        self.retry_after = retry_after


class RateLimited(_AsksToWait):
    """429: the token is over its rate; `retry_after` is the wait the scheduler asked for."""


class ServerError(ApiError):
    """5xx: the scheduler failed."""


class Unavailable(_AsksToWait, ServerError):
    """503: the scheduler (or the database of the run's shard) is down for now."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    412: ChangedMeanwhile,
    413: PayloadTooLarge,
    429: RateLimited,
    503: Unavailable,
}


def error_for(
    status: int,
    problem: dict[str, Any] | None = None,
    *,
    detail: str | None = None,
    retry_after: float | None = None,
) -> ApiError:
    """The exception for an error answer (or one item of a batch answer): by its status, and
    by its problem `type` where one status covers several problems."""
    problem = problem or {}
    detail = detail or str(problem.get("detail") or problem.get("title") or f"HTTP {status}")
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
    if cls is Conflict and str(problem.get("type", "")).endswith("/idempotency-conflict"):
        cls = IdempotencyConflict
    if cls is RateLimited or cls is Unavailable:
        return cls(status, detail, problem=problem, retry_after=retry_after)
    return cls(status, detail, problem=problem)
