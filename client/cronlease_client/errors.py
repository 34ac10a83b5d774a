"""Exceptions: the ones handlers raise to steer retries, and the ones the SDK raises to callers."""

from __future__ import annotations

from typing import Any


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


class ApiError(Exception):
    """The scheduler answered with an error, or could not be reached (`status` None)."""

    def __init__(
        self, status: int | None, detail: str, *, problem: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{status or 'network error'}: {detail}")
        self.status = status
        self.detail = detail
        self.problem = problem or {}

    @property
    def transient(self) -> bool:
        """Whether trying again later may succeed: no answer, throttled, or a server error."""
        return self.status is None or self.status == 429 or self.status >= 500
