"""ASGI entry point: HTTP (API and dashboard) and the dashboard's live-update WebSocket."""

import asyncio
import gc
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import django
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.db import close_old_connections
from django.http import FileResponse, HttpResponse
from django.urls import get_resolver, set_script_prefix

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_site.settings")
if not settings.configured:
    # Served under ASGI, requests run on many threads, so connections are pooled. Settings read
    # this when they load; once they have (a test process importing this module), setting it
    # would only leak into the processes this one starts.
    os.environ.setdefault("SCHEDULER_DB_POOL", "true")


class RequestThreads:
    """Single-thread executors, each lent to one request at a time and kept for the next.

    Django gives each request a ThreadSensitiveContext of its own, for which asgiref starts a
    thread and, when the request ends, another thread to join it: two thread starts per request,
    a third of a small request's CPU. There are as many executors as requests were ever in
    flight at once (long polls included)."""

    def __init__(self) -> None:
        self._idle: list[ThreadPoolExecutor] = []
        self._lock = threading.Lock()

    def lend(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="request")

    def take_back(self, executor: ThreadPoolExecutor) -> None:
        with self._lock:
            self._idle.append(executor)


class BodyTooLarge(Exception):
    """The request body is over DATA_UPLOAD_MAX_MEMORY_SIZE."""


def _declared_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def body_too_large(path: str) -> HttpResponse:
    """The answer to a body over the limit: problem details for the API, a page for a form (a
    browser showed the API's JSON in place of the dashboard)."""
    from django.template import loader

    from apps.api.errors import json_problem  # after django.setup(), below

    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if path.startswith("/api/"):
        return json_problem(413, f"The request body is larger than {limit} bytes.")
    return HttpResponse(loader.get_template("413.html").render({"limit": limit}), status=413)


class SyncChainASGIHandler(ASGIHandler):
    """Django's ASGI handler, with each request's synchronous work done in one thread hop.

    The stock handler crosses from the event loop to a thread for the request_started signal,
    again for every sync-only middleware (WhiteNoise) and MiddlewareMixin hook and for a sync
    view, and once more to close the response. The views and middleware here are synchronous,
    so the signal, the middleware chain, the view and, for a response that is not streamed,
    closing it (request_finished: the connection goes back to the pool) run in one hop, as
    under WSGI, on a thread lent for the request.
    """

    threads = RequestThreads()

    def load_middleware(self, is_async: bool = False) -> None:
        # A synchronous chain: _respond calls it on the request's thread.
        super().load_middleware(is_async=False)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django serves only HTTP connections here, not {scope['type']}.")
        executor = self.threads.lend()
        try:
            # handle() returns only after the request's thread work has ended, so the executor
            # is idle when taken back.
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        finally:
            self.threads.take_back(executor)

    async def handle(self, scope, receive, send) -> None:
        declared = _declared_length(scope)
        try:
            body_file, size = await self.read_bounded_body(receive, declared)
        except RequestAborted:
            return
        except BodyTooLarge:
            await self.send_response(body_too_large(scope.get("path", "")), send)
            return
        if size and declared is None:
            # A chunked body has no Content-Length, and DRF reads a request without one as
            # empty: a retried enqueue then created a second run under a default key. The body
            # has been read whole; its length is known.
            scope = {**scope, "headers": [*scope["headers"], (b"content-length", b"%d" % size)]}
        set_script_prefix(get_script_prefix(scope))
        # Set when the client hangs up. The view goes on in its thread (a thread cannot be
        # cancelled); a long poll reads this to stop claiming for a worker that has gone.
        gone = Hangup()
        watcher = asyncio.create_task(self._watch_disconnect(receive, gone))
        try:
            response = await sync_to_async(self._respond, thread_sensitive=True)(
                scope, body_file, gone
            )
            if gone.is_set():
                # Gone before the answer was sent (it is not): runs it leased go back now
                # rather than when their lease expires.
                if gone.undelivered is not None:
                    await sync_to_async(self._give_back, thread_sensitive=True)(gone.undelivered)
            else:
                try:
                    await self.send_response(response, send)
                except asyncio.CancelledError:
                    pass  # the client went away while the answer was being sent
            if response.streaming:
                await sync_to_async(response.close, thread_sensitive=True)()
        finally:
            watcher.cancel()
            body_file.close()

    async def read_bounded_body(self, receive, declared: int | None) -> tuple[Any, int]:
        """Django's read_body, which buffers whatever arrives (to disk past a few megabytes), with
        the request body limit applied as the bytes come: a body over it, declared or sent, is
        answered 413 before it is stored."""
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if limit is not None and declared is not None and declared > limit:
            raise BodyTooLarge
        body_file = tempfile.SpooledTemporaryFile(
            max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b"
        )
        size = 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise RequestAborted()
                chunk = message.get("body", b"")
                size += len(chunk)
                if limit is not None and size > limit:
                    raise BodyTooLarge
                body_file.write(chunk)
                if not message.get("more_body", False):
                    break
        except BaseException:
            body_file.close()
            raise
        body_file.seek(0)
        return body_file, size

    def _respond(self, scope, body_file, gone: threading.Event) -> HttpResponse:
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, response = self.create_request(scope, body_file)
        if request is not None:
            request.client_gone = gone
            response = self._middleware_chain(request)
            response._handler_class = self.__class__
            if isinstance(response, FileResponse):
                response.block_size = self.chunk_size
        if not response.streaming:
            # The body is in memory: finish the request (request_finished hands the database
            # connection back) before the bytes go out.
            response.close()
        return response

    @staticmethod
    def _give_back(undelivered) -> None:
        try:
            undelivered()
        finally:
            # Outside a request: nothing else hands the connections back.
            close_old_connections()

    @staticmethod
    async def _watch_disconnect(receive, gone: threading.Event) -> None:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()


# Django must be set up before anything imports models (the consumers do).
django.setup(set_prefix=False)
django_application = SyncChainASGIHandler()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from apps.dashboard.routing import websocket_urlpatterns  # noqa: E402
from apps.runs.leasing import Hangup  # noqa: E402


def _settle_garbage_collector() -> None:
    """Load every view now, then leave what the process has built out of the collector's
    passes, and let more objects be made between them.

    What is loaded at start lives as long as the process: frozen, it is no longer walked on
    every pass. With the first generation at 50 000 objects instead of 700, a request's
    short-lived objects (a batch's dicts and datetimes) mostly die before a pass finds them. A
    POST /api/v1/runs of 1 000 runs, in-process: 118 → 96 ms of CPU."""
    get_resolver().url_patterns  # noqa: B018 - imports the views and all they use
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


_settle_garbage_collector()

application = ProtocolTypeRouter(
    {
        "http": django_application,
        # Sockets carry the signed-in session (AuthMiddlewareStack) and only from our own pages.
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
