"""The producer client: create runs and manage jobs, runs, the DLQ and queues from code.

    from cronlease_client import Client

    with Client("https://scheduler.example.com", token) as client:
        run = client.enqueue("billing.send-invoice", payload={"order": 991}, delay=300,
                             idempotency_key="order-991")

`Client` sends on one httpx.Client, `AsyncClient` (the same methods, awaited) on one
httpx.AsyncClient; each keeps its connections for its lifetime. The requests, answers and
retry rules are api.py's: a method here is that module's call, sent.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx

from cronlease_client._version import __version__
from cronlease_client.api import (
    MAX_BODY_BYTES,
    MAX_ENQUEUE,
    Api,
    Call,
    Op,
    RetryPolicy,
    answer,
    next_page,
)
from cronlease_client.api import network_error as _network_error
from cronlease_client.errors import ApiError, NotFound
from cronlease_client.models import Page

logger = logging.getLogger("cronlease_client")

P = ParamSpec("P")
T = TypeVar("T")


class _Driver:
    """What both clients hold: the calls (`Api`), the retry policy and one connection pool."""

    _http_class: type[httpx.Client] | type[httpx.AsyncClient]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in vars(cls).items():
            if getattr(value, "__cronlease_call__", False):
                value.__qualname__ = f"{cls.__name__}.{name}"

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float | httpx.Timeout = 10.0,
        retries: int = 3,
        batch_size: int = MAX_ENQUEUE,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_retry_wait: float = 60.0,
        backoff_base: float = 0.5,
        backoff_cap: float = 10.0,
        http_transport: Any = None,
    ) -> None:
        """`token` needs the `manage` scope. A call failing with 429 or 503 (or no answer) is
        sent again up to `retries` times, waiting what Retry-After asks (up to
        `max_retry_wait` seconds) or a backoff; `batch_size` items per enqueue request (the
        scheduler's limit, SCHEDULER_MAX_ENQUEUE) and at most `max_body_bytes` of JSON (1 MiB:
        under the scheduler's default body limit and an nginx's in front of it).
        `http_transport`: an httpx transport, for tests or proxies."""
        self.api = Api(batch_size=batch_size, max_body_bytes=max_body_bytes)
        self.retry_policy = RetryPolicy(
            retries=retries,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            max_wait=max_retry_wait,
        )
        self._http = self._http_class(
            base_url=url.rstrip("/"),
            headers={
                "Authorization": f"Bearer {token}",
                "Accept": "application/json",
                "User-Agent": f"cronlease-client/{__version__}",
            },
            timeout=timeout,
            transport=http_transport,
        )

    def _retrying(self, call: Call[Any], error: ApiError, failures: int) -> float:
        """The wait before sending `call` again; raise `error` when it is not to be retried."""
        wait = self.retry_policy.wait(call, error, failures)
        if wait is None:
            raise error
        logger.debug(
            "retrying %s %s in %.2fs (failure %d): %s",
            call.method,
            call.path,
            wait,
            failures,
            error,
        )
        return wait


def _method(build: Callable[..., Any], method: Callable[..., Any]) -> Any:
    """`method` under `build`'s name, documentation and arguments (for help() and editors)."""
    method.__name__ = build.__name__
    method.__doc__ = build.__doc__
    method.__module__ = __name__
    method.__signature__ = inspect.signature(build).replace(  # type: ignore[attr-defined]
        return_annotation=inspect.Signature.empty
    )
    method.__cronlease_call__ = True  # type: ignore[attr-defined]
    return method


def _sync(build: Callable[Concatenate[Api, P], Op[T]]) -> Callable[Concatenate[Client, P], T]:
    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._execute(build(self.api, *args, **kwargs))

    return _method(build, method)


def _sync_pages(
    build: Callable[Concatenate[Api, P], Call[Page[T]]],
) -> Callable[Concatenate[Client, P], Iterator[T]]:
    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self._iterate(build(self.api, *args, **kwargs))

    return _method(build, method)


def _async(
    build: Callable[Concatenate[Api, P], Op[T]],
) -> Callable[Concatenate[AsyncClient, P], Awaitable[T]]:
    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._execute(build(self.api, *args, **kwargs))

    return _method(build, method)


def _async_pages(
    build: Callable[Concatenate[Api, P], Call[Page[T]]],
) -> Callable[Concatenate[AsyncClient, P], AsyncIterator[T]]:
    def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        return self._iterate(build(self.api, *args, **kwargs))

    return _method(build, method)


class Client(_Driver):
    """The producer client over one httpx.Client; a context manager, or call `close()`."""

    _http_class = httpx.Client
    _http: httpx.Client

    def _send(self, call: Call[T]) -> T:
        failures = 0
        while True:
            try:
                response = self._http.request(**call.request())
            except httpx.TransportError as exc:
                error: ApiError = _network_error(exc)
            else:
                try:
                    return answer(call, response)
                except ApiError as exc:
                    if failures and call.gone_is_done and isinstance(exc, NotFound):
                        return None  # type: ignore[return-value]  # an earlier try deleted it
                    error = exc
            failures += 1
            time.sleep(self._retrying(call, error, failures))

    def _execute(self, op: Op[T]) -> T:
        if isinstance(op, Call):
            return self._send(op)
        try:
            call = next(op)
            while True:
                try:
                    value = self._send(call)
                except ApiError as error:
                    call = op.throw(error)  # the plan adds what it knows, and raises
                else:
                    call = op.send(value)
        except StopIteration as done:
            return done.value

    def _iterate(self, call: Call[Page[T]] | None) -> Iterator[T]:
        while call is not None:
            page = self._send(call)
            yield from page.items
            call = next_page(call, page)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    enqueue = _sync(Api.enqueue)
    enqueue_many = _sync(Api.enqueue_many)
    get_run = _sync(Api.get_run)
    runs = _sync_pages(Api.runs)
    cancel_run = _sync(Api.cancel_run)
    retry_run = _sync(Api.retry_run)
    dlq = _sync_pages(Api.dlq)
    requeue = _sync(Api.requeue)
    discard = _sync(Api.discard)
    get_job = _sync(Api.get_job)
    list_jobs = _sync(Api.list_jobs)
    put_job = _sync(Api.put_job)
    apply_jobs = _sync(Api.apply_jobs)
    pause_job = _sync(Api.pause_job)
    delete_job = _sync(Api.delete_job)
    resume_job = _sync(Api.resume_job)
    trigger_job = _sync(Api.trigger_job)
    preview = _sync(Api.preview)
    queues = _sync(Api.queues)
    pause_queue = _sync(Api.pause_queue)
    resume_queue = _sync(Api.resume_queue)
    set_queue_rate_limit = _sync(Api.set_queue_rate_limit)


class AsyncClient(_Driver):
    """The producer client over one httpx.AsyncClient: `Client`'s methods, awaited (the lists,
    `runs()` and `dlq()`, are async iterators). `async with`, or call `aclose()`."""

    _http_class = httpx.AsyncClient
    _http: httpx.AsyncClient

    async def _send(self, call: Call[T]) -> T:
        failures = 0
        while True:
            try:
                response = await self._http.request(**call.request())
            except httpx.TransportError as exc:
                error: ApiError = _network_error(exc)
            else:
                try:
                    return answer(call, response)
                except ApiError as exc:
                    if failures and call.gone_is_done and isinstance(exc, NotFound):
                        return None  # type: ignore[return-value]  # an earlier try deleted it
                    error = exc
            failures += 1
            await asyncio.sleep(self._retrying(call, error, failures))

    async def _execute(self, op: Op[T]) -> T:
        if isinstance(op, Call):
            return await self._send(op)
        try:
            call = next(op)
            while True:
                try:
                    value = await self._send(call)
                except ApiError as error:
                    call = op.throw(error)
                else:
                    call = op.send(value)
        except StopIteration as done:
            return done.value

    async def _iterate(self, call: Call[Page[T]] | None) -> AsyncIterator[T]:
        while call is not None:
            page = await self._send(call)
            for item in page.items:
                yield item
            call = next_page(call, page)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    enqueue = _async(Api.enqueue)
    enqueue_many = _async(Api.enqueue_many)
    get_run = _async(Api.get_run)
    runs = _async_pages(Api.runs)
    cancel_run = _async(Api.cancel_run)
    retry_run = _async(Api.retry_run)
    dlq = _async_pages(Api.dlq)
    requeue = _async(Api.requeue)
    discard = _async(Api.discard)
    get_job = _async(Api.get_job)
    list_jobs = _async(Api.list_jobs)
    put_job = _async(Api.put_job)
    apply_jobs = _async(Api.apply_jobs)
    pause_job = _async(Api.pause_job)
    delete_job = _async(Api.delete_job)
    resume_job = _async(Api.resume_job)
    trigger_job = _async(Api.trigger_job)
    preview = _async(Api.preview)
    queues = _async(Api.queues)
    pause_queue = _async(Api.pause_queue)
    resume_queue = _async(Api.resume_queue)
    set_queue_rate_limit = _async(Api.set_queue_rate_limit)
