"""Outcomes: what an attempt came to, and how the scheduler is told with its fencing token.

The worker and the Celery bridge's tasks report the same way: one Report per attempt, sent under
the lease's fencing token in `POST /api/v1/results` (a batch at a time for the worker, one for a
Celery task) or carried by the next lease request (`results`, read back with `read_answers`);
the transport retries what may pass (network errors, 429, 5xx).
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from cronlease_client.errors import ApiError, HandlerError
from cronlease_client.transport import Transport, backoff_delay, batch_items

logger = logging.getLogger("cronlease_client")

MAX_BATCH = 1000  # the server's limit on items in one batch request
MAX_ERROR_MESSAGE = 10000
MAX_ERROR_TYPE = 200
# The scheduler keeps a stack trace's last 64 KB (65 536 characters); cut here too, the same
# way, so a deep recursion's trace does not make the request itself too large.
MAX_STACK = 64 * 1024


def cut_stack(stack: str, limit: int = MAX_STACK) -> str:
    """`stack` itself, or its end (where the error is) under a line saying how much of its start
    was cut, `limit` characters in all (as the scheduler's apps/runs/limits.py cuts it)."""
    if len(stack) <= limit:
        return stack
    marker = ""
    while True:  # the count's digits are part of the length it counts: until it holds still
        kept = limit - len(marker)
        again = f"[{len(stack) - kept} characters cut]\n"
        if again == marker:
            return marker + stack[len(stack) - kept :]
        marker = again


@dataclass(frozen=True)
class Report:
    """What one attempt came to, ready for `POST /api/v1/results`."""

    outcome: Literal["succeeded", "failed"]
    result: Any = None
    error_type: str = ""
    message: str = ""
    retryable: bool = True
    traceback: str = ""  # for this process's log; empty for a deliberate Retryable/NonRetryable
    stack: str = ""  # for the scheduler (`error.stack`): where any exception was raised

    def item(self, run_id: str, fencing_token: int) -> dict[str, Any]:
        if self.outcome == "succeeded":
            return {
                "runId": run_id,
                "fencingToken": fencing_token,
                "outcome": "succeeded",
                "result": self.result,
            }
        # Truncated here: one oversized message must not get the whole batch refused.
        error = {
            "type": self.error_type[:MAX_ERROR_TYPE],
            "message": self.message[:MAX_ERROR_MESSAGE],
        }
        if self.stack:
            error["stack"] = cut_stack(self.stack)
        return {
            "runId": run_id,
            "fencingToken": fencing_token,
            "outcome": "failed",
            "error": error,
            "retryable": self.retryable,
        }


SKIPPED_DRY_RUN = Report("succeeded", {"dryRun": True, "skipped": True})
# A success whose result the scheduler refused as too large (413) is completed with this instead.
RESULT_TOO_LARGE = Report("succeeded", {"resultTooLarge": True})
RESULT_REFUSED = "ResultRefused"


def result_refused(exc: ApiError) -> Report:
    """The failure reported for a success whose result the scheduler refused as invalid (400:
    nested too deep, an integer past 64 bits, a NUL character). Not retryable: the handler
    would most likely return the same result again, and do its work again for nothing."""
    reasons = "; ".join(
        f"{field}: {' '.join(map(str, why)) if isinstance(why, list) else why}"
        for field, why in exc.errors.items()
    )
    message = f"the scheduler refused the result: {exc.detail}"
    if reasons and reasons not in exc.detail:
        message += f" ({reasons})"
    return Report("failed", error_type=RESULT_REFUSED, message=message, retryable=False)


@dataclass(eq=False)
class LeasedRun:
    """One attempt as this process holds it: what its result is sent under, what its logs carry."""

    run_id: str
    job: str
    attempt: int
    token: int  # the lease's fencing token

    def fields(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "job": self.job,
            "attempt": self.attempt,
            "fencing_token": self.token,
        }


def describe_failure(exc: BaseException, ctx_retryable: bool | None = None) -> Report:
    """Turn a handler's exception into a failed Report.

    Retryable/NonRetryable decide for themselves; any other exception is retried unless the
    handler set `ctx.retryable = False`. Either way the scheduler gets the stack trace (with
    the chain of causes), cut to its last 64 KB.
    """
    full = "".join(traceback.format_exception(exc))
    if isinstance(exc, HandlerError):
        cause = exc.__cause__
        error_type = exc.error_type or type(cause if cause is not None else exc).__name__
        message = exc.message or (str(cause) if cause is not None else "")
        retryable = exc.retryable
        # A deliberate Retryable/NonRetryable is an answer, not a bug: no traceback in the log.
        trace = ""
    else:
        error_type = type(exc).__name__
        message = str(exc)
        retryable = ctx_retryable is not False
        trace = full
    return Report(
        "failed",
        error_type=storable(error_type),
        message=storable(message or error_type),
        retryable=retryable,
        traceback=trace,
        stack=storable(cut_stack(full)),
    )


def storable(text: str) -> str:
    """`text` as the scheduler can store it: PostgreSQL's text holds no NUL, and a lone
    surrogate (a file name read with `surrogateescape`, say) is not UTF-8. Both are written as
    escapes; before, such a message was refused (400) and the failure never recorded, or the
    worker stopped on it."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def describe_result(
    value: Any, log: Callable[[], logging.LoggerAdapter[logging.Logger]], source: str
) -> Report:
    """Turn what a handler (`source`) returned into a succeeded Report; its repr if not JSON.
    `log` gives the run's logger, made only when there is something to say (0.6 µs a run
    otherwise)."""
    if value is None or type(value) in (int, bool) or (type(value) is str and value.isascii()):
        return Report("succeeded", value)
    try:
        # As the scheduler reads it: no NaN or Infinity (orjson would send null), and text that
        # is UTF-8 (a lone surrogate stopped the worker, and lost its batch's other results).
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        # The work is done; failing now would only run it again for nothing.
        log().warning("%s result is not JSON; storing its repr", source)
        value = {"unserializable": _repr(value)}
    return Report("succeeded", value)


def _repr(value: Any) -> str:
    try:
        return storable(repr(value)[:1000])
    except RecursionError:
        return f"<{type(value).__name__} nested too deep to show>"


def log_failure(run: LeasedRun, report: Report) -> None:
    logger.warning(
        "run failed run_id=%s job=%s attempt=%s error_type=%s retryable=%s: %s%s",
        run.run_id,
        run.job,
        run.attempt,
        report.error_type,
        report.retryable,
        report.message,
        "\n" + report.traceback.rstrip() if report.traceback else "",
        extra={**run.fields(), "error_type": report.error_type},
    )


Batch = Sequence[tuple[LeasedRun, Report]]


def result_items(batch: Batch) -> list[dict[str, Any]]:
    """The batch as `results` items, for `POST /api/v1/results` or a lease request."""
    return [report.item(run.run_id, run.token) for run, report in batch]


Held = TypeVar("Held", bound=LeasedRun)


def read_answers(
    batch: Sequence[tuple[Held, Report]],
    answers: Sequence[dict[str, Any]],
    *,
    retrying: bool = False,
) -> tuple[dict[str, str], list[tuple[Held, Report]]]:
    """Log the scheduler's answer to each reported outcome. Return {run id: new state} of the
    accepted, and, when `retrying`, the outcomes answered 503 (their shard's database could not
    be reached: nothing was applied) to be sent again."""
    answered = {item["runId"]: item for item in answers}
    states = {}
    again = []
    for run, report in batch:
        item = answered.get(run.run_id, {})
        if retrying and item.get("status") == 503:
            again.append((run, report))
            logger.info(
                "result not taken yet run_id=%s: %s; sending it again",
                run.run_id,
                item.get("detail", ""),
                extra=run.fields(),
            )
        elif _recorded_before(report, item):
            # This outcome was recorded before: a lease request carrying it was cut off by a
            # stop after the scheduler had taken it, and it was sent again.
            states[run.run_id] = str(item["state"])
            logger.info(
                "result already recorded run_id=%s state=%s",
                run.run_id,
                item["state"],
                extra=run.fields(),
            )
        elif item.get("status") == 200:
            states[run.run_id] = str(item.get("state", ""))
            if not logger.isEnabledFor(logging.DEBUG):
                continue
            logger.debug(
                "reported run_id=%s outcome=%s state=%s",
                run.run_id,
                report.outcome,
                item.get("state"),
                extra=run.fields(),
            )
        else:
            logger.warning(
                "result refused run_id=%s job=%s attempt=%s status=%s: %s",
                run.run_id,
                run.job,
                run.attempt,
                item.get("status"),
                item.get("detail", "no answer for this run"),
                extra=run.fields(),
            )
    return states, again


# The states an outcome leaves a run in (`cancelled` when a cancel was asked for meanwhile).
ENDS = {"succeeded": ("succeeded", "cancelled"), "failed": ("retrying", "dead", "cancelled")}


def _recorded_before(report: Report, item: dict[str, Any]) -> bool:
    """A 409 that names the state this lease's run ended in (the scheduler says it only for
    the run's current fencing token), and it is the state this outcome leaves."""
    return item.get("status") == 409 and item.get("state") in ENDS[report.outcome]


# Outcomes answered 503 (their shard's database unreachable) are sent again this many times,
# after growing pauses (0.5 s up to 8 s, half of each random: 8 to 16 s in all): a database
# restart or a failover is over by then; past it the lease expires and the scheduler retries
# the run.
UNAVAILABLE_RETRIES = 5


def send_results(
    http: Transport,
    batch: Batch,
    *,
    attempts: int = 0,
    settled: Callable[[Batch], None] | None = None,
    unavailable_retries: int = UNAVAILABLE_RETRIES,
    unreachable: Callable[[Batch], None] | None = None,
) -> dict[str, str]:
    """Report outcomes in `POST /api/v1/results`; return {run id: new state} of those accepted.

    1. A 400 or 413 for several outcomes: one bad item (say, a result over the size limit) must
       not sink its neighbours, so each is sent again on its own.
    2. A 413 for one success: the run is completed without its result.
    3. A 400 for one success: the result itself is invalid, so the run is failed for good
       (`ResultRefused`, the scheduler's reason as its message) rather than left leased until
       its lease expires and run again to the same end.
    4. A failure that may pass (no answer, 429, 5xx, after the transport's own tries) goes to
       `unreachable` when given: the worker holds the outcomes and sends them again while
       their leases last, rather than let a web restart of 20 s run them twice.
    5. Any other failure is logged: the leases expire and the scheduler retries the runs.
    6. Items answered 503 are sent again, `unavailable_retries` times at most.
    `attempts` is the transport's (its default when 0). Each part of the batch goes to `settled`
    once the scheduler has answered it, or could not be reached.
    """
    try:
        answers = http.post(
            "/api/v1/results",
            {"results": result_items(batch)},
            attempts=attempts,
            parse=batch_items("results"),
        )
    except ApiError as exc:
        if exc.status in (400, 413) and len(batch) > 1:
            states: dict[str, str] = {}
            for one in batch:
                states.update(
                    send_results(
                        http, [one], attempts=attempts, settled=settled, unreachable=unreachable
                    )
                )
            return states
        if exc.status == 413 and batch[0][1].outcome == "succeeded":
            run, _ = batch[0]
            logger.warning("result too large run_id=%s; completing without it", run.run_id)
            return send_results(http, [(run, RESULT_TOO_LARGE)], attempts=attempts, settled=settled)
        if exc.status == 400 and batch[0][1].outcome == "succeeded":
            run, _ = batch[0]
            refused = result_refused(exc)
            logger.warning(
                "result refused run_id=%s job=%s attempt=%s; failing the run: %s",
                run.run_id,
                run.job,
                run.attempt,
                exc,
                extra=run.fields(),
            )
            return send_results(http, [(run, refused)], attempts=attempts, settled=settled)
        if exc.transient and unreachable is not None:
            unreachable(batch)
            return {}
        if len(batch) == 1:
            run, _ = batch[0]
            logger.error(
                "could not report run_id=%s (%s); its lease will expire and the scheduler retry it",
                run.run_id,
                exc,
                extra=run.fields(),
            )
        else:
            logger.error(
                "could not report %d results (%s); their leases will expire and the runs be "
                "retried",
                len(batch),
                exc,
            )
        if settled is not None:
            settled(batch)
        return {}
    states, again = read_answers(batch, answers, retrying=unavailable_retries > 0)
    if again:
        tried = UNAVAILABLE_RETRIES - unavailable_retries + 1
        if not http.cancel.wait(backoff_delay(tried, base=0.5, cap=8.0)):
            states.update(
                send_results(
                    http, again, attempts=attempts, unavailable_retries=unavailable_retries - 1
                )
            )
    if settled is not None:
        settled(batch)
    return states
