"""The callback filter: every IPv4 form an IPv6 address can carry is judged as that IPv4
address, and a delivery connects only to an address that passes (checked offline: nothing
here leaves loopback)."""

import socket
import threading

import pytest

from agents import egress

REFUSED, ALLOWED = "refused", "allowed"

# fmt: off
TABLE = [
    # address in the URL                      carries                  verdict
    ("169.254.169.254",                         "itself",                REFUSED),
    ("8.8.8.8",                                 "itself",                ALLOWED),
    ("[2606:4700:4700::1111]",                  "itself (plain IPv6)",   ALLOWED),
    ("[::1]",                                   "loopback",              REFUSED),
    ("[::ffff:169.254.169.254]",                "IPv4-mapped",           REFUSED),
    ("[::ffff:8.8.8.8]",                        "IPv4-mapped",           ALLOWED),
    ("[::a9fe:a9fe]",                           "IPv4-compatible",       REFUSED),
    ("[::10.0.0.1]",                            "IPv4-compatible",       REFUSED),
    ("[::808:808]",                             "IPv4-compatible",       ALLOWED),
    ("[64:ff9b::a9fe:a9fe]",                    "NAT64 /96",             REFUSED),
    ("[64:ff9b::a00:1]",                        "NAT64 /96",             REFUSED),
    ("[64:ff9b::7f00:1]",                       "NAT64 /96",             REFUSED),
    ("[64:ff9b::808:808]",                      "NAT64 /96",             ALLOWED),
    ("[64:ff9b:1::a00:1]",                      "local NAT64, /96 form", REFUSED),
    ("[64:ff9b:1:a9fe:a9:fe00::]",              "local NAT64, /48 form", REFUSED),
    ("[64:ff9b:1:a:0:1::]",                     "local NAT64, /56 form", REFUSED),
    ("[64:ff9b:1:0:c0:a801::]",                 "local NAT64, /64 form", REFUSED),
    # a public address in one position leaves zeros in another: the local-use range needs allowing
    ("[64:ff9b:1:808:8:800::]",                 "local NAT64, /48 form", REFUSED),
    ("[2002:a9fe:a9fe::]",                      "6to4",                  REFUSED),
    ("[2002:c0a8:101::1]",                      "6to4",                  REFUSED),
    ("[2002:808:808::1]",                       "6to4",                  ALLOWED),
    ("[2001:0:4136:e378:8000:63bf:3fff:fdd2]",  "Teredo",                REFUSED),
    ("[fd00::1]",                               "unique local",          REFUSED),
]
# fmt: on


@pytest.mark.parametrize(("host", "form", "verdict"), TABLE, ids=[f"{h} {f}" for h, f, _ in TABLE])
def test_the_filter_judges_the_ipv4_address_an_address_carries(settings, host, form, verdict):
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = []
    refusal = egress.callback_refusal(f"http://{host}/hook", resolve=False)
    assert (REFUSED if refusal else ALLOWED) == verdict, refusal


def test_an_allowed_network_allows_its_addresses_in_their_embedded_forms_too(settings):
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = ["10.0.0.0/8", "64:ff9b:1::/48"]
    for host in ("10.0.0.1", "[64:ff9b::a00:1]", "[2002:a00:1::]", "[::ffff:10.0.0.1]", "[64:ff9b:1:808:8:800::]"):
        assert egress.callback_refusal(f"http://{host}/", resolve=False) is None, host
    assert egress.callback_refusal("http://[64:ff9b::a9fe:a9fe]/", resolve=False)


@pytest.fixture
def listener():
    """A loopback socket that would accept a connection, to tell whether one was made."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        sock.settimeout(0.5)
        yield sock


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_delivery_connects_only_to_an_address_that_passes_at_connection_time(settings, listener, scheme):
    # `localhost` is resolved by the connection itself here: the check sees what it connects to.
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = []
    url = f"{scheme}://localhost:{listener.getsockname()[1]}/hook"
    with pytest.raises(egress.CallbackRefused, match="private or reserved"):
        egress.checked_session().post(url, data=b"{}", timeout=2)
    with pytest.raises(TimeoutError):
        listener.accept()  # no connection was even opened


def test_a_delivery_to_an_allowed_address_connects(settings, listener):
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
    session = egress.checked_session()
    answered = threading.Event()

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            answered.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert session.post(url, data=b"{}", timeout=5).status_code == 204
    assert answered.is_set()
