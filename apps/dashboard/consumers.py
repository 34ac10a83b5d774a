"""The live-update socket: one per open dashboard page (htmx's ws extension connects it)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from urllib.parse import parse_qs, urlsplit

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from apps.dashboard import live

VOLATILE = re.compile(r'name="csrfmiddlewaretoken" value="[^"]*"|<span class="age">[^<]*</span>')
log = logging.getLogger(__name__)

CLOSE_UNAUTHORISED = 4401  # the session ended
CLOSE_BAD_PAGE = 4400  # not a live page, or not the user's, when the socket opens
CLOSE_PAGE_GONE = 4404  # what an open page shows was deleted, or is no longer the user's
# The overview aggregates the most; on a busy system it need not redraw every second.
MIN_SECONDS_BETWEEN_RENDERS = {"/": 10.0, "/queues": 3.0}
# A page asking for its regions again renders them no more often than this.
MIN_SECONDS_BETWEEN_ASKED_RENDERS = 1.0
AGAIN = '{"again":true}'


class LiveConsumer(AsyncWebsocketConsumer):
    """Sends the page's live regions, re-rendered for this user, whenever the runs change."""

    subscribed = False
    last_render = 0.0
    last_sent = ""
    pending: asyncio.Task | None = None

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHORISED)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        self.page = live.live_path((query.get("path") or [""])[0])
        if self.page is None:
            await self.close(code=CLOSE_BAD_PAGE)
            return
        # The page as it is now: one that is not this user's to see (another team's run, which
        # its view records as an attempt) is refused here, not re-rendered at every change.
        try:
            opened = await database_sync_to_async(live.render)(self.scope, self.page, opening=True)
        except live.PageGone:
            opened = None
        except live.PASSING:
            # A database blip as the socket opens: the page was served a moment ago, and
            # refusing it showed "updates stopped" for good (the next change renders it).
            log.warning("live page %s not rendered as its socket opened", self.page, exc_info=True)
            opened = ""
        if opened is None:
            await self.close(code=CLOSE_BAD_PAGE)
            return
        await self.channel_layer.group_add(live.GROUP, self.channel_name)
        await self.accept()
        self.seen = live.broadcaster.last
        self.subscribed = True
        live.broadcaster.subscribe()

    async def disconnect(self, code: int) -> None:
        if self.pending is not None:
            self.pending.cancel()
        if self.subscribed:
            self.subscribed = False
            live.broadcaster.unsubscribe()
            await self.channel_layer.group_discard(live.GROUP, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """The page asks for its regions again (`{"again":true}`) once its actions have their
        answers: it held the updates that came meanwhile (static/dashboard/dashboard.js), so what
        was last sent is not what it shows. At most once a second; anything else is ignored."""
        if text_data != AGAIN:
            return
        self.last_sent = ""  # a render already due is sent, whatever was sent before
        if self.pending is not None and not self.pending.done():
            return
        wait = self.last_render + MIN_SECONDS_BETWEEN_ASKED_RENDERS - time.monotonic()
        self.pending = asyncio.get_running_loop().create_task(self._render_after(max(wait, 0.0)))

    async def live_changed(self, event: dict) -> None:
        if event["fingerprint"] == self.seen:
            return
        self.seen = event["fingerprint"]
        if self.pending is not None and not self.pending.done():
            return  # a render is already due; it will show this change too
        gap = MIN_SECONDS_BETWEEN_RENDERS.get(urlsplit(self.page).path, 0.0)
        wait = self.last_render + gap - time.monotonic()
        if wait > 0:
            self.pending = asyncio.get_running_loop().create_task(self._render_after(wait))
        else:
            await self._render()

    async def _render_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.subscribed:
            await self._render()

    async def _render(self) -> None:
        self.last_render = time.monotonic()
        try:
            html = await database_sync_to_async(live.render)(self.scope, self.page)
        except live.PageGone:
            await self.close(code=CLOSE_PAGE_GONE)
            return
        except live.PASSING:
            # A database down or failing for a moment: the page keeps what it shows and its
            # socket (an error here closed it, and its updates stopped until a reload); the
            # next change renders it again.
            log.warning("live page %s not rendered", self.page, exc_info=True)
            return
        if html is None:
            await self.close(code=CLOSE_UNAUTHORISED)
        elif html.strip() and (shown := VOLATILE.sub("", html)) != self.last_sent:
            # What the page shows already is not sent again: every change anywhere re-renders
            # the page, and a run that had not changed was swapped in again and again (47
            # times in 30 s), closing its unfolded stack trace and moving the reader's place.
            # Told apart without what differs at every render and changes nothing the reader
            # sees: the CSRF token's mask, and ages, which the page's script counts on.
            self.last_sent = shown
            await self.send(text_data=html)
