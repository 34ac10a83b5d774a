"""The hot endpoints' own dispatch: DRF's checks, in DRF's order, without its objects.

Workers call their endpoints thousands of times a second, and applications the bulk enqueue. DRF's dispatch (a Request wrapper,
content negotiation, a Response and its renderer around authentication and throttling) cost
0.1–0.2 CPU-ms of every call (bench/README.md, "Where the time goes", item 14). A call that is
not a plain JSON POST (another method, body type or Accept header, or a query string) goes
through DRF's dispatch, which answers it as it always has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.http import HttpRequest, HttpResponse
from rest_framework import exceptions
from rest_framework.views import APIView

from apps.api.auth import KEYWORD, TokenUser, authenticate_bearer
from apps.api.errors import problem_exception_handler
from apps.api.parsers import parse_json
from apps.api.permissions import missing_scope
from apps.api.renderers import render_json
from apps.teams.models import ApiToken

# What DRF's content negotiation would answer with JSON, the one renderer, without parsing.
JSON_ACCEPTS = frozenset({"", "*/*", "application/json"})


@dataclass
class Call:
    """A hot endpoint's request, whichever path dispatched it."""

    request: HttpRequest
    user: TokenUser
    token: ApiToken
    data: Any = None
    # Headers of the answer that the view adds (e.g. `Preference-Applied`).
    headers: dict[str, str] = field(default_factory=dict)

    # The throttles and the enqueue path read these where DRF's Request keeps them.
    @property
    def auth(self) -> ApiToken:
        return self.token

    @property
    def method(self) -> str:
        return self.request.method or ""

    @classmethod
    def of(cls, request: Any) -> Call:
        """The call of a request DRF dispatched (its `Request`)."""
        return cls(request._request, request.user, request.auth, request.data)


class FastPathView:
    """An APIView mixin: plain JSON POSTs go to `answer(call, **kwargs)` through `dispatch`
    below; anything else through DRF's dispatch, whose `post` should answer
    `answer(Call.of(request), **kwargs)`."""

    def answer(self, call: Call, **kwargs: Any) -> Any:
        raise NotImplementedError

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if takes(request):
            self.args, self.kwargs, self.request = args, kwargs, request
            return dispatch(self, request, lambda call: self.answer(call, **kwargs))
        return super().dispatch(request, *args, **kwargs)  # type: ignore[misc]


def takes(request: HttpRequest) -> bool:
    return (
        request.method == "POST"
        and request.content_type == "application/json"
        and request.META.get("HTTP_ACCEPT", "") in JSON_ACCEPTS
        and not request.META.get("QUERY_STRING")  # `?format=` is DRF's to answer
    )


def dispatch(view: APIView, request: HttpRequest, answer: Callable[[Call], dict]) -> HttpResponse:
    """Authenticate, check the scope, throttle, parse, answer: each failure as DRF answers it."""
    headers = {"Allow": ", ".join(view.allowed_methods)}
    try:
        principal = authenticate_bearer(request)
        if principal is None:
            raise exceptions.NotAuthenticated()
        call = Call(request, *principal)
        refusal = missing_scope(call.token, view.required_scope)
        if refusal is not None:
            raise exceptions.PermissionDenied(refusal)
        waits = [
            throttle.wait()
            for throttle in view.get_throttles()
            if not throttle.allow_request(call, view)
        ]
        if waits:
            raise exceptions.Throttled(max((w for w in waits if w is not None), default=None))
        body = request.body
        # DRF reads an empty body as an empty object, whatever its type.
        call.data = (
            parse_json(
                body,
                items=getattr(view, "body_items", None),
                repeated_keys=getattr(view, "repeated_keys", False),
            )
            if body
            else {}
        )
        data = answer(call)
        return HttpResponse(
            render_json(data), content_type="application/json", headers=headers | call.headers
        )
    except Exception as exc:
        if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
            exc.auth_header = KEYWORD
        problem = problem_exception_handler(exc, {"view": view, "request": request})
        if problem is None:
            raise  # not an API error: Django's 500 handler answers, as under DRF
        for name, value in problem.headers.items():
            if name.lower() != "content-type":
                headers[name] = value
        return HttpResponse(
            render_json(problem.data),
            status=problem.status_code,
            content_type="application/problem+json",
            headers=headers,
        )
