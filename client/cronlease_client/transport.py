"""JSON over HTTP to the scheduler, with bounded retries for failures that may pass.

The worker's transport: one keep-alive connection of the standard library's `http.client` per
thread. It carries a worker's every lease, heartbeat and result; on httpx (URL merging, cookies,
auth and redirect handling, its response model around each request) a worker spent 44-50 µs of
CPU a run at batch 100, on `http.client` 29-34 (bench/README.md, "the worker's HTTP"). The
producer `Client` (client.py), whose callers want httpx's async twin and its transports, stays
on httpx.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import select
import socket
import ssl
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlencode, urlsplit

try:  # With the `fast` extra. A batch of 100 leases: 170 µs to encode with the standard
    # library, 13 µs with orjson; decoding 37 µs against 16 µs.
    import orjson
except ImportError:  # pragma: no cover - exercised where orjson is not installed
    orjson = None  # type: ignore[assignment]

from cronlease_client._version import __version__
from cronlease_client.errors import ApiError, BadAnswer, NetworkError, error_for

logger = logging.getLogger("cronlease_client")
JSON_BODY = {"Content-Type": "application/json"}
# After interrupt() hangs up, how long a server gets to answer or close before the reading half
# is shut too. The scheduler closes within milliseconds of the hang-up; this bounds a server or
# proxy that does not notice it.
HANGUP_SECONDS = 2.0
T = TypeVar("T")


def backoff_delay(failures: int, *, base: float, cap: float) -> float:
    """Return the wait before retry `failures` (1-based): exponential, capped, half jittered.

    Half of the delay is random so a fleet of workers that lost the server together does not
    come back in lockstep; the other half keeps a floor so retries do not bunch up at zero.
    """
    ceiling = min(cap, base * 2.0 ** min(failures - 1, 30))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header in seconds: a number of seconds, or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def encode(body: Any) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(body)
        except TypeError:
            pass  # an integer past 64 bits, say: the standard library writes it
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def decode(content: bytes) -> Any:
    """JSON to Python; ValueError when it is not JSON (orjson's error is a ValueError too)."""
    return orjson.loads(content) if orjson is not None else json.loads(content)


def _problem(status: int, reason: str, content: bytes) -> tuple[str, dict[str, Any]]:
    try:
        body = decode(content)
    except ValueError:
        return content[:500].decode(errors="replace") or reason, {}
    if isinstance(body, dict):
        return str(body.get("detail") or body.get("title") or reason), body
    return reason, {}


def _shut(sock: socket.socket, how: int) -> None:
    """Shut down a direction of a connection, TLS or not. `socket.socket`'s own method on a TLS
    socket too: the TLS socket's would drop its TLS state, and the rest of an answer still to be
    read after a half-close would be read as raw bytes."""
    try:
        socket.socket.shutdown(sock, how)
    except OSError:  # already closed, by either side
        pass


def _dropped(sock: Any) -> bool:
    """A kept-alive connection the server has closed (or sent something unasked on): readable
    while no answer is due. Checked before each request, so a request is not sent into it."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class Transport:
    """One keep-alive HTTP connection to the scheduler, used by one thread of the worker."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 10.0,
        attempts: int = 5,
        backoff_base: float = 0.2,
        backoff_cap: float = 5.0,
        cancel: threading.Event | None = None,
    ) -> None:
        self.attempts = attempts
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.timeout = timeout
        # Set when waiting out a backoff is no longer worth it (the worker is going away).
        self.cancel = cancel or threading.Event()
        url = urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the scheduler's URL must be http:// or https://, not {base_url!r}")
        self._scheme, self._host, self._port = url.scheme, url.hostname, url.port
        self._prefix = url.path
        self._headers = {
            "Authorization": f"Bearer {token}",
            "User-Agent": f"cronlease-client/{__version__}",
            "Accept": "application/json",
        }
        self._conn: http.client.HTTPConnection | None = None
        # Set by interrupt(); `_guard` orders it against a request taking its socket.
        self._interrupted = False
        self._guard = threading.Lock()

    def post(
        self,
        path: str,
        body: dict[str, Any],
        *,
        timeout: float | None = None,
        attempts: int = 0,
        parse: Callable[[Any], Any] | None = None,
    ) -> Any:
        """POST `body` as JSON and return the decoded answer (`parse`d, when given).

        Network errors, 429, 5xx and a success answer that is not JSON (or that `parse` refuses
        with ValueError, TypeError or KeyError) are retried up to `attempts` times in all (the
        transport's default when 0) with exponential backoff; any other error status raises
        ApiError at once, as does the last failure.
        """
        return self.request(
            "POST", path, body=body, timeout=timeout, attempts=attempts, parse=parse
        )

    def get(
        self,
        path: str,
        params: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        attempts: int = 0,
    ) -> Any:
        """GET `path` and return the decoded answer, retrying as `post` does."""
        return self.request("GET", path, params=params, timeout=timeout, attempts=attempts)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        attempts: int = 0,
        parse: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Send one request with the retry rules of `post`; return the decoded JSON answer."""
        tries = attempts or self.attempts
        target = self._prefix + path + (f"?{urlencode(params, doseq=True)}" if params else "")
        content = None if body is None else encode(body)
        for attempt in range(1, tries + 1):
            wait: float | None = None
            try:
                status, reason, headers, answer = self._send(
                    method, target, content, self.timeout if timeout is None else timeout
                )
            except (OSError, http.client.HTTPException) as exc:
                error: ApiError = NetworkError(f"{type(exc).__name__}: {exc}")
            else:
                if status < 400:
                    try:
                        return read_answer(status, answer, parse)
                    except BadAnswer as exc:
                        error = exc
                else:
                    detail, problem = _problem(status, reason, answer)
                    wait = retry_after_seconds(headers.get("Retry-After"))
                    error = error_for(status, problem, detail=detail, retry_after=wait)
                    if not error.transient:
                        raise error
            if attempt == tries or self.cancel.is_set() or self._interrupted:
                raise error
            if wait is None:
                wait = backoff_delay(attempt, base=self.backoff_base, cap=self.backoff_cap)
            logger.debug(
                "retrying path=%s attempt=%d in %.2fs: %s",
                path,
                attempt,
                wait,
                error,
                extra={"path": path, "attempt": attempt},
            )
            if self.cancel.wait(wait):
                raise error
        raise AssertionError("unreachable")

    def _send(
        self, method: str, target: str, content: bytes | None, timeout: float
    ) -> tuple[int, str, http.client.HTTPMessage, bytes]:
        """One exchange on the kept connection (a new one when there is none or the server
        closed it); any failure closes it, so the next attempt starts on a fresh one."""
        conn = self._conn
        if conn is not None and conn.sock is not None and _dropped(conn.sock):
            conn.close()
        if conn is None:
            conn = self._conn = self._connect()
        # The timeout bounds each wait on the socket (connect, send, each read), as httpx's did.
        conn.timeout = timeout
        headers = self._headers if content is None else self._headers | JSON_BODY
        try:
            if conn.sock is None:
                conn.connect()
            conn.sock.settimeout(timeout)
            # The socket exists before the check: an interrupt() after it finds the socket and
            # shuts it down, one before it stops the request here.
            with self._guard:
                if self._interrupted:
                    raise ConnectionAbortedError("the request was interrupted")
            conn.request(method, target, body=content, headers=headers)
            response = conn.getresponse()
            answer = response.read()
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("HTTP %s %s: %d %s", method, target, response.status, response.reason)
        return response.status, response.reason, response.headers, answer

    def _connect(self) -> http.client.HTTPConnection:
        if self._scheme == "https":
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self.timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)

    def interrupt(self) -> None:
        """From another thread: end the request under way (a long poll) and refuse later ones.

        Only the sending half of the connection is shut down. The scheduler sees the hang-up
        and either closes without an answer (a long poll's claim is rolled back; runs already
        committed are given back) or has answered before it saw it: that answer is then read
        whole. Shutting the reading half too cut off an answer whose body was still arriving,
        and its leases stayed taken, known to neither side, until they expired. A server that
        neither answers nor closes within `HANGUP_SECONDS` is cut off all the same."""
        with self._guard:
            self._interrupted = True
            sock = self._conn.sock if self._conn is not None else None
            if sock is None:
                return
            _shut(sock, socket.SHUT_WR)
        cut = threading.Timer(HANGUP_SECONDS, self._cut, (sock,))
        cut.daemon = True
        cut.start()

    def _cut(self, sock: socket.socket) -> None:
        """Wake a read still waiting on `sock` once the server has had its chance to answer."""
        with self._guard:
            if self._conn is not None and self._conn.sock is sock:
                _shut(sock, socket.SHUT_RDWR)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def read_answer(status: int, answer: bytes, parse: Callable[[Any], T] | None) -> T | Any:
    """The decoded (and parsed) success answer; BadAnswer when it is not JSON or not of its
    shape. The worker's transport and the producer client (api.py) both read answers here."""
    try:
        value = decode(answer)
    except ValueError as exc:
        raise BadAnswer(status, f"the answer is not JSON: {answer[:100]!r}") from exc
    if parse is None:
        return value
    try:
        return parse(value)
    except (ValueError, TypeError, KeyError) as exc:
        raise BadAnswer(
            status, f"the answer is not of its shape ({exc}): {answer[:100]!r}"
        ) from exc


def batch_items(key: str) -> Callable[[Any], list[dict[str, Any]]]:
    """A parser of a batch answer (`{key: [{"runId": …, …}, …]}`): its list of items."""

    def parse(answer: Any) -> list[dict[str, Any]]:
        items = answer[key] if isinstance(answer, dict) else None
        if not isinstance(items, list):
            raise TypeError(f"{key} is not a list")
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("runId"), str):
                raise TypeError(f"an item of {key} has no runId")
        return items

    return parse


# What a worker needs of each lease to run it and report it; the other fields are optional.
LEASE_FIELDS = (("runId", str), ("job", str), ("idempotencyKey", str))
LEASE_NUMBERS = ("attempt", "fencingToken")


def lease_answer(answer: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A parser of `POST /api/v1/leases`'s answer: its leases, and its results (the answers to
    the outcomes the request carried; none when it carried none)."""
    leases = batch_items("leases")(answer)
    for lease in leases:
        for name, kind in LEASE_FIELDS:
            if not isinstance(lease.get(name), kind):
                raise TypeError(f"a lease's {name} is not a {kind.__name__}")
        for name in LEASE_NUMBERS:
            value = lease.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"a lease's {name} is not a number")
    results = batch_items("results")(answer) if "results" in answer else []
    return leases, results


class Refusal(NamedTuple):
    """A heartbeat the scheduler refused: why, and whether it is because the run was cancelled
    (the worker should stop it and still report; its problem type ends in `/cancelled`) or its
    lease expired with the run not yet reaped (`/lease-expired`: its result is still taken)."""

    detail: str
    cancelled: bool = False
    expired: bool = False


def heartbeat_leases(
    http: Transport, leases: list[tuple[str, int]], *, timeout: float, batch: int
) -> dict[str, Refusal]:
    """Extend leases with `POST /api/v1/heartbeats`, `batch` at a time.

    Return a Refusal by run id for the leases the scheduler no longer honours (404 or 409:
    done, reaped, taken over, or cancelled). A request that fails is only logged: the next
    round tries again, and a lease has rounds to spare before it expires.
    """
    lost: dict[str, Refusal] = {}
    for start in range(0, len(leases), batch):
        chunk = leases[start : start + batch]
        body = {"leases": [{"runId": run_id, "fencingToken": token} for run_id, token in chunk]}
        try:
            items = http.post(
                "/api/v1/heartbeats", body, timeout=timeout, parse=batch_items("leases")
            )
        except ApiError as exc:
            logger.warning("heartbeat of %d leases failed: %s", len(chunk), exc)
            continue
        for item in items:
            if item.get("status") in (404, 409):
                kind = str(item.get("type", ""))
                lost[item["runId"]] = Refusal(
                    item.get("detail", ""),
                    cancelled=kind.endswith("/cancelled"),
                    expired=kind.endswith("/lease-expired"),
                )
    return lost
