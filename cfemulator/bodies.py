"""A request's body as the emulator reads it from its client: whole for an API call, piece by
piece, as workerd takes it, for a script's call; either way bounded as Cloudflare bounds it."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

# Bodies above this are refused before they are read (Cloudflare's request limit).
MAX_BODY_BYTES = 100 * 1024 * 1024
# Bodies are relayed in pieces of at most this many bytes, as they arrive.
PIECE = 64 * 1024


class BodyTooLarge(Exception):
    """The request body is over MAX_BODY_BYTES."""


class RequestBody:
    """A call's request body, read from the client only as workerd takes it.

    `length` is the Content-Length when the client sent one, None when it is chunked (it is
    then sent on chunked). Raises BodyTooLarge or ValueError (bad framing) when made, or
    while read for a chunked body.
    """

    def __init__(self, handler: BaseHTTPRequestHandler) -> None:
        self._rfile = handler.rfile
        self.chunked = "chunked" in (handler.headers.get("Transfer-Encoding") or "").lower()
        self.length: int | None = None
        if not self.chunked:
            self.length = int(handler.headers.get("Content-Length") or 0)
            if self.length < 0:
                raise ValueError("negative Content-Length")
            if self.length > MAX_BODY_BYTES:
                raise BodyTooLarge
        self.started = False
        self.finished = not self.chunked and not self.length

    def pieces(self) -> Iterator[bytes] | None:
        """The body for urllib3: None when there is none, else its pieces as they arrive."""
        if self.finished:
            return None
        return self._read_chunked() if self.chunked else self._read_length()

    def whole(self) -> bytes:
        """All of it at once (an API or control call's)."""
        pieces = self.pieces()
        return b"".join(pieces) if pieces is not None else b""

    def _read_length(self) -> Iterator[bytes]:
        self.started = True
        yield from self._next(self.length or 0)
        self.finished = True

    def _read_chunked(self) -> Iterator[bytes]:
        self.started = True
        total = 0
        while size := int(self._rfile.readline(1024).split(b";", 1)[0].strip() or b"0", 16):
            total += size
            if total > MAX_BODY_BYTES:
                raise BodyTooLarge
            yield from self._next(size)
            self._rfile.readline(8)
        # Trailer fields, if any, end with an empty line.
        while self._rfile.readline(8192) not in (b"\r\n", b"\n", b""):
            pass
        self.finished = True

    def _next(self, count: int) -> Iterator[bytes]:
        """The next `count` bytes, in pieces as they arrive. Raises ConnectionError when the
        client hangs up before."""
        while count:
            piece = self._rfile.read(min(count, PIECE))
            if not piece:
                raise ConnectionError("the client hung up before the end of its body")
            count -= len(piece)
            yield piece
