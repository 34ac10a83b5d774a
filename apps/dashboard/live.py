"""Live updates without touching the hot path.

Nothing on the claim, heartbeat, complete or fail path sends anything for the dashboard. Instead,
each web process that has dashboard sockets open reads a *fingerprint* of the runs once a second
(`settings.DASHBOARD_LIVE_INTERVAL`): five numbers, each from an index, that change whenever a run
is inserted, leased, finished (completed, failed, reaped) or changed by a person (every such
change writes an audit event). When it changes, the process tells the channel-layer group; each
socket then re-renders its page's live regions for its own user, through the page's own view,
and sends them as HTMX out-of-band swaps.

With REDIS_URL set the group spans every web process; each socket ignores a fingerprint it has
already rendered, so several processes announcing the same change cost one render per socket.
"""

from __future__ import annotations

import asyncio
import logging
from http.cookies import SimpleCookie
from importlib import import_module
from typing import Any
from urllib.parse import urlsplit

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth import get_user
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError, close_old_connections, connections
from django.http import Http404, HttpRequest, QueryDict
from django.middleware.csrf import CsrfViewMiddleware
from django.template.loader import render_to_string
from django.urls import Resolver404, resolve
from django_htmx.middleware import HtmxDetails

from apps.runs import shards

logger = logging.getLogger(__name__)

GROUP = "dashboard.live"

# The pages whose `live` partial a socket may ask for.
LIVE_PAGES = frozenset(
    {"overview", "failures", "runs", "dlq", "run", "jobs", "job", "queues", "workers"}
)

# Each sub-select is served by one index and reads a row or a handful:
#   max(id) of runs      primary key: a run was inserted (materialiser, trigger, API)
#   max(id) of attempts  primary key: a lease was taken
#   leased count         partial index run_leased_expiry (leased rows only): a lease ended —
#                        completed, failed or reaped. Together with the attempts: any lease event.
#   max(id) of audit     primary key: a person or token changed something (retry, cancel,
#                        requeue, discard, pause, edit)
#   15-second bucket     time alone turns waiting runs `ready` and ages grow
# On every shard database:
RUNS_FINGERPRINT = """
SELECT (SELECT max(id) FROM runs_run),
       (SELECT max(id) FROM runs_attempt),
       (SELECT count(*) FROM runs_run WHERE state = 'leased')
"""
# On the control database:
CONTROL_FINGERPRINT = """
SELECT (SELECT max(id) FROM audit_auditevent), floor(extract(epoch FROM now()) / 15)::bigint
"""


def fingerprint() -> str:
    """What changes whenever a page could: the runs' part from each shard database (one that is
    down, or back, changes it too), the audit trail's and the clock's from the control database."""
    close_old_connections()

    def runs_part() -> tuple:
        with shards.cursor() as cursor:
            cursor.execute(RUNS_FINGERPRINT)
            return cursor.fetchone()

    parts, unavailable = shards.gather(runs_part)
    with connections[shards.CONTROL].cursor() as cursor:
        cursor.execute(CONTROL_FINGERPRINT)
        parts.append(cursor.fetchone())
    return ":".join(str(value) for part in parts for value in part) + "/" + ",".join(unavailable)


class Broadcaster:
    """One per process: polls the fingerprint while at least one local socket listens."""

    def __init__(self) -> None:
        self.listeners = 0
        self.last: str | None = None
        self._task: asyncio.Task | None = None

    def subscribe(self) -> None:
        self.listeners += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def unsubscribe(self) -> None:
        self.listeners = max(0, self.listeners - 1)

    async def _run(self) -> None:
        layer = get_channel_layer()
        while self.listeners > 0:
            try:
                current = await database_sync_to_async(fingerprint)()
                if current != self.last:
                    self.last = current
                    await layer.group_send(GROUP, {"type": "live.changed", "fingerprint": current})
            except Exception:  # a database blip must not end live updates for good
                logger.exception("live-update poll failed")
            await asyncio.sleep(settings.DASHBOARD_LIVE_INTERVAL)


broadcaster = Broadcaster()


def live_path(raw: str) -> str | None:
    """Accept a page path for a socket only if it is one of the live dashboard pages."""
    parts = urlsplit(raw or "")
    if parts.scheme or parts.netloc or not parts.path.startswith("/"):
        return None
    try:
        match = resolve(parts.path)
    except Resolver404:
        return None
    if match.namespace != "dashboard" or match.url_name not in LIVE_PAGES:
        return None
    return raw


def _cookies(scope: dict[str, Any]) -> dict[str, str]:
    if "cookies" in scope:
        return dict(scope["cookies"])
    jar = SimpleCookie()
    for name, value in scope.get("headers", []):
        if name == b"cookie":
            jar.load(value.decode("latin-1"))
    return {key: morsel.value for key, morsel in jar.items()}


class PageGone(Exception):
    """What the page shows was deleted, or is no longer the user's to see."""


class RenderFailed(Exception):
    """The page could not be rendered now (its view answered 5xx): the socket keeps its page
    and renders it again at the next change, as for a database error raised on the way."""


# What the socket keeps its page through: the next change renders it again.
PASSING = (RenderFailed, DatabaseError, shards.Unavailable)


def render(scope: dict[str, Any], path: str, *, opening: bool = False) -> str | None:
    """Render a page's `live` partial as its user would GET it now; "" if there is nothing,
    None once the user is signed out; `PageGone` once the page is not there for them. Either
    way the socket is then closed, with a code that tells the page which. A view answering
    5xx raises RenderFailed, and a database's error goes through: neither ends the socket.

    The request goes through the page's own view, so the same access checks apply on every
    update: a removed member, a user signed out (or whose session expired, or whose password
    changed) stops receiving data at the next change. Forms in the partial carry a CSRF token
    valid for the socket's own cookie. `opening`: the render that decides whether the socket
    opens, whose refusal is audited as a page's would be (not the re-renders').
    """
    close_old_connections()
    user = _signed_in(scope)
    if user is None:
        return None
    parts = urlsplit(path)
    match = resolve(parts.path)
    request = HttpRequest()
    request.method = "GET"
    request.path = request.path_info = parts.path
    request.GET = QueryDict(parts.query)
    request.COOKIES = _cookies(scope)
    host = dict(scope.get("headers", [])).get(b"host", b"localhost").decode("latin-1")
    request.META = {
        # `request.get_full_path()` (the `next` of a page's forms) keeps the page's filters.
        "QUERY_STRING": parts.query,
        "HTTP_HOST": host,
        "SERVER_NAME": host.split(":")[0],
        "SERVER_PORT": "80",
        "HTTP_HX_REQUEST": "true",
    }
    request.user = user
    request.live = True  # type: ignore[attr-defined]
    request.from_socket = not opening  # type: ignore[attr-defined]
    request.htmx = HtmxDetails(request)
    CsrfViewMiddleware(lambda r: None).process_request(request)
    with shards.noting():  # as UnavailableShardsMiddleware does for a page
        try:
            response = match.func(request, *match.args, **match.kwargs)
        except (Http404, PermissionDenied) as exc:  # gone, or no longer the user's to see
            raise PageGone(path) from exc
        if response.status_code >= 500:
            raise RenderFailed(f"{path} answered {response.status_code}")
        if response.status_code != 200:
            raise PageGone(path)
        html = response.content.decode()
        if not html.strip():
            return html
        # The banner of the shards it could not read, with the regions: a database that went
        # down left a list without its rows and no word of why (and it goes once it is back).
        return html + render_to_string(
            "dashboard/_unavailable.html", {"unavailable_shards": shards.noted()}
        )


def _signed_in(scope: dict[str, Any]) -> Any:
    """The socket's user while its session still signs them in, else None: the user the socket
    opened with is not enough, as sign-out ends the session and not the socket."""
    session = scope.get("session")
    request = HttpRequest()
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(
        getattr(session, "session_key", None)
    )
    user = get_user(request)
    opened_by = getattr(scope.get("user"), "pk", None)
    if not user.is_authenticated or not user.is_active or user.pk != opened_by:
        return None
    return user
