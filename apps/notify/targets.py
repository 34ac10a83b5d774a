"""Where a channel may send: the syntax of its target, and the SSRF guard.

A webhook or Slack URL must be http(s) with a host name. Its host is resolved and every address
it names must be a global one: loopback, private, shared, link-local (cloud metadata at
169.254.169.254), reserved, unspecified and multicast addresses are refused, IPv4 inside IPv6
included, unless `SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS` is true. The check runs when a channel
is saved and again at every delivery, and the delivery connects to the very address that was
checked (`pinned`), so a name that resolves elsewhere between the check and the connection
(DNS rebinding) cannot lead it inside.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import EmailValidator

MAX_TARGET = 2000
SCHEMES = ("http", "https")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class TargetRefused(ValueError):
    """The target may not be sent to; the message says why, in words for its owner."""


class TargetUnresolved(TargetRefused):
    """The target's host does not resolve now (DNS may answer later: a delivery retries)."""


def url_problem(url: str) -> str | None:
    """Why `url` is not a URL a channel can post to; None when it is."""
    if len(url) > MAX_TARGET:
        return f"At most {MAX_TARGET} characters."
    if any(ch.isspace() or ord(ch) < 32 for ch in url):
        return "A URL has no spaces or control characters."
    try:
        parts = urlsplit(url)
        port = parts.port  # a port out of range or not a number raises here
        # As the sender will read it: its host rules (IDNA 2008) refuse names the socket
        # library takes (full-width letters), which were saved and then never delivered.
        httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"Not a valid URL: {exc}."
    except ValueError:
        return "Not a valid URL."
    if parts.scheme not in SCHEMES:
        return "An http:// or https:// URL."
    if not parts.hostname:
        return "The URL names no host."
    if parts.username is not None or parts.password is not None:
        # Every member of the team reads a channel's target; the signature is what tells the
        # receiver a message comes from here.
        return "No user name or password in the URL: the team's members all read it."
    if port == 0:
        return "Not a valid port."
    return None


def email_problem(address: str) -> str | None:
    """Why `address` is not an email address; None when it is."""
    if len(address) > 254:
        return "At most 254 characters."
    try:
        EmailValidator()(address)
    except ValidationError:
        return "Not a valid email address."
    return None


# IPv6 forms that reach an IPv4 address written inside them: a NAT64 gateway's well-known prefix
# (RFC 6052) and 6to4 (RFC 3056) carry it in their bits, the deprecated IPv4-compatible form
# (::a.b.c.d) in its last 32. Python's is_global calls them global whatever the IPv4 address is
# (64:ff9b::a9fe:a9fe is 169.254.169.254, the cloud metadata service, through a NAT64).
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215: local use, never global
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # RFC 2765 (SIIT), in its last 32
# The 6to4 relays' anycast prefix (RFC 7526: deprecated): Python calls it global, but what
# answers there is whichever relay is nearest, often inside the network.
SIX_TO_FOUR_RELAYS = ipaddress.IPv4Network("192.88.99.0/24")
# Ranges not globally reachable that this Python's is_global (3.11) still calls global: the
# IETF protocol assignments (RFC 6890; the two anycast addresses in it are refused with the
# rest), IPv6 site-local (RFC 3879: deprecated, still routed inside some networks), IPv6
# documentation (RFC 9637) and SRv6 SIDs (RFC 9602).
NOT_GLOBAL = (
    ipaddress.IPv4Network("192.0.0.0/24"),
    ipaddress.IPv6Network("fec0::/10"),
    ipaddress.IPv6Network("3fff::/20"),
    ipaddress.IPv6Network("5f00::/16"),
)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    # :: and ::1 are IPv6's own unspecified and loopback addresses, not IPv4-compatible ones.
    if address in NAT64 or address in IPV4_TRANSLATED:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in IPV4_COMPATIBLE and int(address) > 1:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_problem(address: Address) -> str | None:
    """What kind of address a channel may not send to this is (SSRF), e.g. "a loopback
    address"; None when it may."""
    if isinstance(address, ipaddress.IPv6Address):
        if address in NAT64_LOCAL:
            return "a private or reserved address"
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            address = embedded
    if address.is_multicast:
        return "a multicast address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if (
        address.is_private
        or not address.is_global
        or address in SIX_TO_FOUR_RELAYS
        or any(address in network for network in NOT_GLOBAL)
    ):
        return "a private or reserved address"
    return None


def allow_private() -> bool:
    return bool(settings.SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS)


@dataclass(frozen=True)
class Resolved:
    """A URL's host, port and the addresses it resolved to (checked unless allowed)."""

    host: str
    port: int
    addresses: list[Address]


def resolve(url: str) -> Resolved:
    """Resolve the URL's host and check every address it names; raise TargetRefused."""
    reason = url_problem(url)
    if reason is not None:
        raise TargetRefused(reason)
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise TargetUnresolved(f"The host {host} cannot be resolved ({exc}).") from None
    addresses: list[Address] = []
    for *_, sockaddr in found:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise TargetUnresolved(f"The host {host} resolves to no address.")
    if not allow_private():
        for address in addresses:
            kind = address_problem(address)
            if kind is None:
                continue
            named = host if address.compressed == host.strip("[]") else f"{host} ({address})"
            raise TargetRefused(
                f"{named} is {kind}: targets on loopback or private addresses are refused "
                "(SCHEDULER_NOTIFY_ALLOW_PRIVATE_TARGETS)."
            )
    return Resolved(host, port, addresses)


def check_url(url: str) -> None:
    """The check when a channel is saved: the syntax, then (unless private targets are
    allowed, where the name may not even resolve from here) the addresses."""
    reason = url_problem(url)
    if reason is not None:
        raise TargetRefused(reason)
    if not allow_private():
        resolve(url)
