"""What every dashboard view shares: the typed request, sign-in, page/partial rendering, and the
answer to a POST (post/redirect/get, or an HTMX redirect)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme
from django_htmx.http import HttpResponseClientRedirect
from django_htmx.middleware import HtmxDetails

from apps.audit.record import Actor, record_denied
from apps.runs.clock import format_utc


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


def signed_in(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Send signed-out requests to the sign-in page (an HTMX request gets a client redirect)."""

    @wraps(view)
    def wrapper(request: HtmxHttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            if getattr(request, "htmx", False):
                return HttpResponseClientRedirect(settings.LOGIN_URL)
            return redirect_to_login(request.get_full_path())
        return view(request, *args, **kwargs)

    return wrapper


def is_live(request: HttpRequest) -> bool:
    """Whether the live-update socket renders this page (apps/dashboard/live.py sets `live` on
    the request it builds). An attribute, not a header: a browser's request cannot claim it."""
    return getattr(request, "live", False)


def render_page(
    request: HtmxHttpRequest,
    template: str,
    context: dict[str, Any],
    *,
    regions: Iterable[str] = (),
    status: int = 200,
) -> HttpResponse:
    """Render the whole page, or the region an HTMX request targets when the view names it in
    `regions` (`page.html#region`), or the page's `live` partial for the live-update socket on
    a page whose context says it is live (others have no such partial: no update, a 404)."""
    if is_live(request):
        if not context.get("live"):
            raise Http404("This page has no live updates.")
        name = f"{template}#live"
    elif request.htmx and not request.htmx.boosted and request.htmx.target in set(regions):
        name = f"{template}#{request.htmx.target}"
    else:
        name = template
    return render(request, name, context, status=status)


def actor(request: HttpRequest) -> Actor:
    return Actor.for_user(request.user)


def record_refused(request: HttpRequest, team: Any, target_type: str, target: Any) -> None:
    """Record a person's attempt on another team's objects as `access.denied`, as the API
    records a token's; the page answers as if they did not exist. Not a live socket's
    re-render (`from_socket`, set by apps/dashboard/live.py, not by any header a client can
    send): that socket was refused when it opened, and is closed now."""
    if getattr(request, "from_socket", False):
        return
    record_denied(
        actor(request),
        f"{request.method} {request.path}",
        team=team,
        target_type=target_type,
        target=target,
    )


def next_url(request: HttpRequest, fallback: str) -> str:
    """The page to go back to after a POST: `next` when it is one of ours, else `fallback`."""
    candidate = request.POST.get("next") or request.GET.get("next") or ""
    if candidate and url_has_allowed_host_and_scheme(
        candidate, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return candidate
    return fallback


def done(
    request: HtmxHttpRequest, fallback: str, message: str = "", level: int = messages.SUCCESS
) -> HttpResponse:
    """Answer a POST that changed something: flash the message, then go (back) to a page."""
    if message:
        messages.add_message(request, level, message)
    target = next_url(request, fallback)
    if request.htmx:
        return HttpResponseClientRedirect(target)
    return redirect(target)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def already(what: str, state: str, event: Any) -> str:
    """The words for an action a stale page asked for that someone had done already: who did
    it and when, from its audit event (None: the trail has none, as for a pause made before
    the trail was kept)."""
    if event is None:
        return f"{what} was {state} already: nothing changed."
    at = format_utc(event.created_at.replace(microsecond=0))
    return f"{what} was {state} already (by {event.actor} at {at}): nothing changed."
