"""A TCP relay on a fixed loopback port in front of another one, that a test opens and closes:
closed, nothing listens there (a connection is refused, as a server that is down refuses it);
open, every connection is copied both ways to the target."""

from __future__ import annotations

import contextlib
import socket
import threading

from sigil.ports import free_port


class Relay:
    """`127.0.0.1:port` relayed to `127.0.0.1:target`; closed until `open()`."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open(self) -> None:
        """Listen on the port and relay what connects. Idempotent."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="relay-accept", daemon=True).start()

    def close(self) -> None:
        """Stop listening and cut every relayed connection: the port refuses connections. Idempotent."""
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._connections |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_copy, args=(source, sink), name="relay-copy", daemon=True).start()


def _copy(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
