"""WebSocket upgrades through the emulator, passed as Cloudflare passes them to a Worker.

A call whose `Upgrade` header is `websocket` (workerd's own test for a WebSocket request) and
that carries no body reaches the script's workerd with its `Upgrade`, `Connection` and
`Sec-WebSocket-*` headers, on a connection of its own. When the script answers `101` (a
`Response` with a `webSocket`), that head goes back to the client as workerd wrote it
(`Sec-WebSocket-Accept` is workerd's, for the client's own key), and from then on the emulator
only copies bytes between the client's socket and workerd's, both ways, frames and all, until
both sides have hung up: extensions such as permessage-deflate are the two ends' business.
Any other answer (the script's 426, a guard's 403) is an ordinary HTTP answer.

A session is one call: it is metered against the call's CPU limit for as long as it lasts,
and it ends when the script's process is stopped (the client sees the connection drop).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

WEBSOCKET = "websocket"
#: hop-by-hop headers that an upgrade carries on to the script, and back in its 101
UPGRADE_HEADERS = frozenset({"upgrade", "connection"})
SWITCHING_PROTOCOLS = 101
# Bytes are relayed in pieces of at most this many, as they arrive.
_PIECE = 64 * 1024
# Once one side has hung up, how long the other has to send its last bytes (a WebSocket's
# closing handshake) before both connections are cut.
HANGUP_GRACE_SECONDS = 5.0


def is_websocket_upgrade(method: str, upgrade: str | None) -> bool:
    """Whether a call asks for a WebSocket: a GET whose `Upgrade` is `websocket` (any case)."""
    return method == "GET" and (upgrade or "").strip().lower() == WEBSOCKET


class HandshakeFailed(Exception):
    """workerd did not answer the upgrade. `refused`: it did not even take the connection
    (its process is stopped or restarting), so nothing of the call ran."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class _Source:
    """What http.client.HTTPResponse reads a head from: the handshake's own buffered reader, so
    that bytes workerd sent right after its 101 stay there for the relay."""

    def __init__(self, reader: BinaryIO) -> None:
        self._reader = reader

    def makefile(self, mode: str) -> BinaryIO:
        return self._reader


@dataclass
class Handshake:
    """workerd's answer to an upgrade, and the connection it came on (the caller closes it)."""

    sock: socket.socket
    reader: BinaryIO
    response: http.client.HTTPResponse

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def upgraded(self) -> bool:
        return self.response.status == SWITCHING_PROTOCOLS

    def headers(self) -> list[tuple[str, str]]:
        """The answer's header fields, in order, repeated ones included."""
        return list(self.response.msg.items())

    def pieces(self) -> Iterator[bytes]:
        """The body of an answer that is no 101, as it arrives (unchunked). Raises HandshakeFailed
        when workerd breaks it off."""
        try:
            while piece := self.response.read1(_PIECE):
                yield piece
        except (OSError, http.client.HTTPException) as exc:
            raise HandshakeFailed(f"workerd broke off its answer: {exc!r}", refused=False) from exc

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.close()
        with contextlib.suppress(OSError):
            self.sock.close()


def open_upgrade(
    address: tuple[str, int],
    method: str,
    target: str,
    headers: Iterable[tuple[str, str]],
    *,
    connect_timeout: float,
    read_timeout: float,
) -> Handshake:
    """Send an upgrade request to the workerd at `address` on a fresh connection, and read the
    head of its answer. Raises HandshakeFailed when workerd cannot be reached or does not answer."""
    try:
        sock = socket.create_connection(address, timeout=connect_timeout)
    except ConnectionRefusedError as exc:
        raise HandshakeFailed(f"workerd refused the upgrade's connection: {exc}", refused=True) from exc
    except OSError as exc:
        raise HandshakeFailed(f"workerd could not be reached for the upgrade: {exc}", refused=False) from exc
    reader = None
    try:
        sock.settimeout(read_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lines = [f"{method} {target} HTTP/1.1", *(f"{name}: {value}" for name, value in headers)]
        # http.server reads header fields as Latin-1; they go out as they came.
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        reader = sock.makefile("rb")
        response = http.client.HTTPResponse(_Source(reader), method=method)
        response.begin()
    except (OSError, http.client.HTTPException) as exc:
        if reader is not None:
            reader.close()
        sock.close()
        raise HandshakeFailed(f"workerd did not answer the upgrade: {exc!r}", refused=False) from exc
    return Handshake(sock=sock, reader=reader, response=response)


def relay(client: socket.socket, client_reader: BinaryIO, handshake: Handshake) -> None:
    """Copy bytes between the client and workerd, both ways, until both have hung up (or one
    has, and the other did not within HANGUP_GRACE_SECONDS); then cut both connections.

    Each side's end is passed on as it happens: when one hangs up, the other's writing half
    is shut, so it sees the end and can finish its closing handshake. Never raises for a side
    that breaks off: that ends the session as a hang-up does.
    """
    client.settimeout(None)  # a session may stay idle as long as both sides keep it open
    handshake.sock.settimeout(None)
    ended = threading.Event()

    def pump(source: BinaryIO, sink: socket.socket) -> None:
        try:
            while piece := source.read1(_PIECE):
                sink.sendall(piece)
        except (OSError, ValueError):  # reset, or the reader closed while cutting
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
            ended.set()

    pumps = [
        threading.Thread(target=pump, args=(client_reader, handshake.sock), name="ws-to-workerd", daemon=True),
        threading.Thread(target=pump, args=(handshake.reader, client), name="ws-to-client", daemon=True),
    ]
    for thread in pumps:
        thread.start()
    ended.wait()
    deadline = time.monotonic() + HANGUP_GRACE_SECONDS
    for thread in pumps:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in pumps):
        for sock in (client, handshake.sock):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in pumps:
            thread.join()
    handshake.close()
