"""An ASGI application that does no work: every request, `/_health` among them, is answered
`200` with the body `pong` (what bench/storm.py's quiet calls expect) once its body has been
read. Served by the same server command as Sigil (testsupport.servers.server_command with
`application=BARE_APPLICATION`), it is the server's own floor: what the server and the machine
cost a request before Sigil does anything.

Served by granian from the checkout's root, as `bench.bare_asgi:application`.
"""

from __future__ import annotations

BARE_APPLICATION = "bench.bare_asgi:application"

START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"4")],
}
BODY = {"type": "http.response.body", "body": b"pong"}


async def application(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(START)
    await send(BODY)
