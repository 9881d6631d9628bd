"""Where Sigil may send what an agent asks it to send: a call's callback (`X-Callback-Url`).

An agent names that URL, so unchecked it could make Sigil's workers POST into the operator's
own network: Redis, the database, a cloud's metadata service, anything on loopback. A
callback may reach public addresses only, and the networks the operator lists in
SIGIL_CALLBACK_ALLOWED_NETWORKS. The owner's webhook URLs (set in the admin) are not checked:
the owner chose them.

The check runs when the call is accepted (an address written in the URL: a clear 400 at
once), again before each delivery on every address the name resolves to then, and last on
the address the delivery connects to (`checked_session`): the name is resolved once more
there, and only an address that passes is connected to, so a name made to resolve elsewhere
after the first check (DNS rebinding) gains nothing.

An IPv6 address can carry an IPv4 one that a translator or tunnel on the way turns into a
connection to that IPv4 address (NAT64, 6to4, IPv4-mapped and -compatible forms), and
Python's `ipaddress` calls most of those forms global: the decision is made on the IPv4
addresses an address carries, every one of them, and on the address itself only when it
carries none.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import unicodedata
from urllib.parse import unquote, urlsplit

import requests
from django.conf import settings
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def callback_refusal(url: str, *, resolve: bool) -> str | None:
    """Why `url` may not be a callback, or None when it may. With `resolve`, a host name is
    resolved and every address it has is checked (OSError when it cannot be resolved: worth
    another try); without, only an address written in the URL (in any form a resolver takes
    for one: `2130706433`, `0x7f.1`, `0177.0.0.1`, `127.1`, an IPv6 literal) and `localhost`."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is no number, or out of range
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return "X-Callback-Url must be an absolute http or https URL"
    host = parts.hostname
    addresses = written_addresses(host)
    if not addresses and resolve:
        addresses = _resolved(host, port)
    for address in addresses:
        reason = address_refusal(address)
        if reason:
            where = f"names {host}" if host == str(address) else f"names {host}, which is at {address}"
            return (
                f"X-Callback-Url {where}: a private or reserved address ({reason}). Callbacks go to public "
                "addresses only (the operator may allow a network with SIGIL_CALLBACK_ALLOWED_NETWORKS)"
            )
    return None


# What a resolver reads as an IPv4 address although `ipaddress` does not: inet_aton's forms,
# one to four parts, each decimal, octal (leading 0) or hexadecimal (0x).
_NUMERIC_HOST = re.compile(r"^[0-9a-fx.]+$", re.IGNORECASE)
# Dots that IDNA (UTS #46, as requests encodes a host) maps to a full stop.
_DOTS = str.maketrans({"\u3002": ".", "\uff0e": ".", "\uff61": "."})


def written_addresses(host: str) -> list[Address]:
    """The addresses a URL's host names without asking DNS: an IP address in any written form
    a resolver or HTTP client accepts (inet_aton's numeric forms, a trailing dot, IPv6 with a
    zone, percent-encoded or full-width characters), 127.0.0.1 for `localhost`; [] for a name."""
    found: list[Address] = []
    for form in _host_forms(host):
        if form == "localhost" or form.endswith(".localhost"):
            found.append(ipaddress.ip_address("127.0.0.1"))
            continue
        try:
            found.append(ipaddress.ip_address(form.strip("[]").split("%", 1)[0]))
            continue
        except ValueError:
            pass
        if _NUMERIC_HOST.match(form):
            with contextlib.suppress(OSError):  # not one of inet_aton's forms: a name
                found.append(ipaddress.IPv4Address(socket.inet_aton(form)))
    return list(dict.fromkeys(found))


def _host_forms(host: str) -> list[str]:
    forms = []
    for form in (host, unquote(host)):
        for spelled in (form, unicodedata.normalize("NFKC", form).translate(_DOTS)):
            spelled = spelled.lower()
            forms += [spelled, spelled.rstrip(".")]
    return [form for form in dict.fromkeys(forms) if form]


def address_refusal(address: Address) -> str | None:
    """Why a callback may not connect to `address` (`loopback`, `private`, …), or None when
    it may: the operator allows it, or every IPv4 address it carries (else the address itself)
    is public or allowed. The one rule, at write time and at each delivery."""
    allowed = [ipaddress.ip_network(network, strict=False) for network in settings.SIGIL_CALLBACK_ALLOWED_NETWORKS]
    if _in(address, allowed):
        return None
    for form in embedded_ipv4(address) or [address]:
        if (form.is_global and not form.is_multicast) or _in(form, allowed):
            continue
        kind = next(
            (
                name
                for name, test in (
                    ("loopback", form.is_loopback),
                    ("unspecified", form.is_unspecified),
                    ("link-local", form.is_link_local),
                    ("multicast", form.is_multicast),
                    ("private", form.is_private),
                    ("reserved", form.is_reserved),
                )
                if test
            ),
            "not global",
        )
        return f"{form} is {kind}" if form == address else f"{address} carries {form}, which is {kind}"
    return None


def _resolved(host: str, port: int) -> list[Address]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]


NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215
SIX_TO_FOUR = ipaddress.ip_network("2002::/16")  # RFC 3056
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # RFC 4291, deprecated but still routed by some stacks
# Where RFC 6052 puts the IPv4 address for each prefix length a local-use NAT64 network
# (a /48 or longer inside 64:ff9b:1::/48) may have: the byte offsets of its four octets
# (byte 8 is always zero, so the address skips it).
_RFC6052_OFFSETS = {48: (6, 7, 9, 10), 56: (7, 9, 10, 11), 64: (9, 10, 11, 12), 96: (12, 13, 14, 15)}


def embedded_ipv4(address: Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses `address` may lead to through a translator or tunnel: none for an
    IPv4 address or a plain IPv6 one; for a local-use NAT64 address, every position its
    network's prefix length may put one at (that length is the translator's operator's,
    unknown here), so such an address passes only where the operator allows the range."""
    if isinstance(address, ipaddress.IPv4Address):
        return []
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    if address.sixtofour is not None:
        return [address.sixtofour]
    packed = address.packed
    if address in NAT64_WELL_KNOWN:
        return [ipaddress.IPv4Address(packed[12:])]
    if address in NAT64_LOCAL:
        return [ipaddress.IPv4Address(bytes(packed[i] for i in offsets)) for offsets in _RFC6052_OFFSETS.values()]
    if address in IPV4_COMPATIBLE and int(address) > 1:  # :: and ::1 are not IPv4 addresses
        return [ipaddress.IPv4Address(packed[12:])]
    return []


def _in(address: Address, networks: list) -> bool:
    return any(address.version == network.version and address in network for network in networks)


class CallbackRefused(Exception):
    """Every address a callback's host resolves to at connection time is one it may not reach.
    Not an OSError, so neither urllib3 nor requests retries it or takes it for a network fault."""


def _connect_checked(host: str, port: int, timeout, source_address, socket_options) -> socket.socket:
    """Connect to the first address of `host` that a callback may reach, as urllib3's
    create_connection does with every address; raises CallbackRefused when none may be."""
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
        infos = [(socket.AF_INET if literal.version == 4 else socket.AF_INET6, str(literal))]
    except ValueError:
        infos = [
            (family, sockaddr[0])
            for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        ]
    error: OSError | None = None
    refused = []
    for family, text in infos:
        address = ipaddress.ip_address(text.split("%", 1)[0])
        if address_refusal(address):
            refused.append(text)
            continue
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            if isinstance(timeout, int | float):
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect((text, port))
            return sock
        except OSError as exc:
            error = exc
            sock.close()
    if error is not None:
        raise error
    raise CallbackRefused(f"{host} is at {', '.join(refused)}: a private or reserved address")


class _CheckedHTTPConnection(HTTPConnection):
    def _new_conn(self) -> socket.socket:
        return _connect_checked(self._dns_host, self.port, self.timeout, self.source_address, self.socket_options)


class _CheckedHTTPSConnection(HTTPSConnection):
    def _new_conn(self) -> socket.socket:
        return _connect_checked(self._dns_host, self.port, self.timeout, self.source_address, self.socket_options)


class _CheckedHTTPConnectionPool(HTTPConnectionPool):
    ConnectionCls = _CheckedHTTPConnection


class _CheckedHTTPSConnectionPool(HTTPSConnectionPool):
    ConnectionCls = _CheckedHTTPSConnection


class _CheckedAdapter(HTTPAdapter):
    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": _CheckedHTTPConnectionPool,
            "https": _CheckedHTTPSConnectionPool,
        }


def checked_session() -> requests.Session:
    """A requests session that connects only to addresses a callback may reach (raising
    CallbackRefused otherwise). It takes no proxy from the environment: the address it checks
    must be the one it connects to."""
    session = requests.Session()
    session.trust_env = False
    adapter = _CheckedAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session
