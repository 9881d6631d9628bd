"""Where Sigil may send what an agent asks it to send: a call's callback (`X-Callback-Url`).

An agent names that URL, so unchecked it could make Sigil's workers POST into the operator's
own network: Redis, the database, a cloud's metadata service, anything on loopback. A
callback may reach public addresses only, and the networks the operator lists in
SIGIL_CALLBACK_ALLOWED_NETWORKS. The owner's webhook URLs (set in the admin) are not checked:
the owner chose them.

The check runs when the call is accepted (an address written in the URL: a clear 400 at
once) and again before each delivery, on every address the name resolves to then. Between
that resolution and the connection a name could still be made to resolve elsewhere (DNS
rebinding); an operator who must rule that out too restricts the workers' egress.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from django.conf import settings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def callback_refusal(url: str, *, resolve: bool) -> str | None:
    """Why `url` may not be a callback, or None when it may. With `resolve`, a host name is
    resolved and every address it has is checked (OSError when it cannot be resolved: worth
    another try); without, only an address written in the URL (and `localhost`) is."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is no number, or out of range
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return "X-Callback-Url must be an absolute http or https URL"
    host = parts.hostname
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        if host == "localhost" or host.endswith(".localhost"):
            addresses = [ipaddress.ip_address("127.0.0.1")]
        elif resolve:
            addresses = _resolved(host, port)
        else:
            return None
    refused = [address for address in addresses if not _may_reach(address)]
    if not refused:
        return None
    where = f"names {host}" if host == str(refused[0]) else f"names {host}, which is at {refused[0]}"
    return (
        f"X-Callback-Url {where}: a private or reserved address. Callbacks go to public addresses only "
        "(the operator may allow a network with SIGIL_CALLBACK_ALLOWED_NETWORKS)"
    )


def _resolved(host: str, port: int) -> list[Address]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]


def _may_reach(address: Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_global and not address.is_multicast:
        return True
    allowed = settings.SIGIL_CALLBACK_ALLOWED_NETWORKS
    return any(address in ipaddress.ip_network(network, strict=False) for network in allowed)
