"""Who may read the operations endpoints (/metrics, /readyz): the monitoring networks, and the
operations token when one is set. /healthz stays open for load balancers."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from functools import lru_cache, wraps
from ipaddress import IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from apps.api.errors import json_problem
from apps.teams.lockout import client_address


@lru_cache(maxsize=8)
def _networks(cidrs: tuple[str, ...]) -> tuple[IPv4Network | IPv6Network, ...]:
    return tuple(ip_network(cidr, strict=False) for cidr in cidrs)


def allowed_network(request: HttpRequest) -> bool:
    """Return whether the client's address is in SCHEDULER_OPS_ALLOWED_NETWORKS.

    An address that does not parse (none at all, a port appended by a proxy) is refused.
    """
    try:
        address = ip_address(client_address(request).strip())
    except ValueError:
        return False
    # A dual-stack socket reports IPv4 clients as ::ffff:a.b.c.d.
    if isinstance(address, IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    networks = _networks(tuple(settings.SCHEDULER_OPS_ALLOWED_NETWORKS))
    return any(address in network for network in networks)


def has_ops_token(request: HttpRequest) -> bool:
    """Return whether the request carries SCHEDULER_OPS_TOKEN (always true when it is unset)."""
    expected = settings.SCHEDULER_OPS_TOKEN
    if not expected:
        return True
    scheme, _, given = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), expected.encode()
    )


def ops_only(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Serve the view to the monitoring networks only, and with the ops token when one is set.

    1. A client outside SCHEDULER_OPS_ALLOWED_NETWORKS gets 403, token or not.
    2. With SCHEDULER_OPS_TOKEN set, a request without `Authorization: Bearer <it>` gets 401.
    """

    @wraps(view)
    def guarded(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if not allowed_network(request):
            return json_problem(
                403, "This endpoint answers clients in SCHEDULER_OPS_ALLOWED_NETWORKS only."
            )
        if not has_ops_token(request):
            response = json_problem(401, "This endpoint needs the operations bearer token.")
            response["WWW-Authenticate"] = 'Bearer realm="ops"'
            return response
        return view(request, *args, **kwargs)

    return guarded
