"""ASGI entry point: the engine in front of Django, on one event loop per server process.

Paths Sigil serves itself (`/_api/`, `/_health`, `/_status/`, `/admin/`, `/static/`, ...) go to
Django's ASGI handler, which runs its views in threads as it always has; `/_mcp` to the MCP
endpoint; every other path is a call (HTTP or WebSocket) and goes straight to the engine, which
waits on events and holds no thread. The process's async call runners start with the server
(ASGI lifespan) and stop with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sigil_site.settings")

from django.conf import settings
from django.core.asgi import get_asgi_application

from sigil.edge_handoff import handoff_key
from sigil.request_id import new_request_id, set_request_id

django_application = get_asgi_application()

from capabilities.engine.adapter import serve_http, serve_websocket  # noqa: E402  (needs Django set up)
from capabilities.engine.engine import Engine  # noqa: E402
from capabilities.engine.runner import AsyncCallRunner  # noqa: E402
from capabilities.mcp.endpoint import McpEndpoint  # noqa: E402

logger = logging.getLogger(__name__)

# Where a request goes, by its path, read in one place (destination()): Sigil's own paths,
# each matched whole or by a prefix, the first row that matches winning; every other path is a
# call, for the engine. Agent names start with a letter and exclude these, so the two never
# overlap.
MCP, DJANGO, ENGINE = "mcp", "django", "engine"
OWN_PATHS: tuple[tuple[frozenset[str], tuple[str, ...], str], ...] = (
    (frozenset({"/_mcp"}), (), MCP),
    (frozenset({"/"}), ("/_", "/admin", "/static/", "/metrics", "/favicon.ico", "/llms.txt"), DJANGO),
)


def destination(path: str) -> str:
    """Which of MCP, DJANGO and ENGINE serves `path` (OWN_PATHS)."""
    for whole, prefixes, where in OWN_PATHS:
        if path in whole or path.startswith(prefixes):
            return where
    return ENGINE


class SigilApplication:
    def __init__(self, django_app) -> None:
        self.django_app = django_app
        self.engine: Engine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.mcp = McpEndpoint(engine=self.get_engine)
        self.runner = AsyncCallRunner(self.get_engine)
        self.runner_task: asyncio.Task | None = None
        self.retired: list[Engine] = []
        self.closing: set[asyncio.Future] = set()
        self.proxies = settings.SIGIL_TRUSTED_PROXY_COUNT
        self.edge_key = handoff_key(settings.SIGIL_INTERNAL_SECRET)
        # Each destination's handlers: of an HTTP request, of a WebSocket. Only calls open one.
        self.handlers = {
            MCP: (self.serve_mcp, refuse_websocket),
            DJANGO: (self.serve_django, refuse_websocket),
            ENGINE: (self.serve_call, self.serve_websocket_call),
        }

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self.lifespan(receive, send)
        # Every line logged while serving this request names it (sigil/logs.py).
        request_id = new_request_id()
        set_request_id(request_id)
        http, websocket = self.handlers[destination(scope["path"])]
        return await (websocket if kind == "websocket" else http)(scope, receive, send, request_id)

    async def serve_call(self, scope, receive, send, request_id: str) -> None:
        await serve_http(
            self.get_engine(), scope, receive, send, request_id=request_id, proxies=self.proxies, edge_key=self.edge_key
        )

    async def serve_websocket_call(self, scope, receive, send, request_id: str) -> None:
        await serve_websocket(
            self.get_engine(), scope, receive, send, request_id=request_id, proxies=self.proxies, edge_key=self.edge_key
        )

    async def serve_mcp(self, scope, receive, send, request_id: str) -> None:
        await self.mcp(scope, receive, send)

    async def serve_django(self, scope, receive, send, request_id: str) -> None:
        scope = {**scope, "sigil.request_id": request_id}
        if _chunked_without_length(scope):
            scope, receive = await buffer_chunked_body(scope, receive)
        await self.django_app(scope, receive, send)

    def get_engine(self) -> Engine:
        if self.engine is None:
            # Built on first use, inside the server process's event loop (after any fork).
            self.engine = Engine()
        return self.engine

    def reset_engine(self) -> None:
        """Build the engine afresh on next use (the settings changed: tests); the old one is
        closed on its loop."""
        old, self.engine = self.engine, None
        if old is not None and self.loop is not None and self.loop.is_running():
            # Later, so that what the old engine still has in flight can end.
            self.retired.append(old)
            self.loop.call_soon_threadsafe(self.loop.call_later, RETIRED_ENGINE_GRACE_SECONDS, self.close_retired, old)

    def close_retired(self, engine: Engine) -> None:
        if engine in self.retired:
            self.retired.remove(engine)
            closing = asyncio.ensure_future(engine.aclose())
            self.closing.add(closing)
            closing.add_done_callback(self.closing.discard)

    async def lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.loop = asyncio.get_running_loop()
                self.runner_task = asyncio.create_task(self.runner.run(), name="sigil-async-runner")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.runner_task is not None:
                    self.runner_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await self.runner_task
                for engine in [*self.retired, *([self.engine] if self.engine else [])]:
                    with contextlib.suppress(Exception):
                        await engine.aclose()
                self.engine, self.retired = None, []
                await send({"type": "lifespan.shutdown.complete"})
                return


RETIRED_ENGINE_GRACE_SECONDS = 30


async def refuse_websocket(scope, receive, send, request_id: str) -> None:
    """A WebSocket to one of Sigil's own paths: none of them speaks it."""
    await receive()
    await send({"type": "websocket.close", "code": 1008})


def _chunked_without_length(scope) -> bool:
    has_length = chunked = False
    for name, value in scope["headers"]:
        if name == b"content-length":
            has_length = True
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    return chunked and not has_length


async def buffer_chunked_body(scope, receive):
    """Give Django a chunked body with its length: Django's request (and DRF's parsers) read a
    body by its Content-Length only, so a chunked deploy would look empty. Read up to the deploy
    limit and one byte more, so that an oversized one is still refused by the API's own check."""
    limit = settings.SIGIL_DEPLOY_MAX_BODY_BYTES + 1
    chunks, size = [], 0
    while size < limit:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body"):
            break
    body = b"".join(chunks)[:limit]
    headers = [(k, v) for k, v in scope["headers"] if k != b"transfer-encoding"]
    headers.append((b"content-length", str(len(body)).encode()))
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        while True:  # what is left of an oversized body is dropped as it comes
            message = await receive()
            if message["type"] != "http.request":
                return message

    return {**scope, "headers": headers}, replay


application = SigilApplication(django_application)


def development_application() -> SigilApplication:
    """The same, with the admin's static files served by Django (`make dev`, under uvicorn)."""
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    return SigilApplication(ASGIStaticFilesHandler(django_application))


from capabilities.services import runtime_ready  # noqa: E402

# A web process serves capabilities: Sigil's own Worker (and its namespace) must exist before
# the first call, not after a first deploy. Done while the server loads the application, so
# it answers ready; a failure is logged and /_health reports it.
runtime_ready(actor="system")

# What the process has loaded by now (Django, the apps, their modules) lives as long as it does.
# Frozen, it is left out of the cyclic collector's full passes, which otherwise walk all of it
# (some 160,000 objects, 80-180 ms on a 2-core machine) when a burst of requests has filled the
# younger generations: a stall of the one event loop every call waits on (bench/storm.py).
gc.collect()
gc.freeze()
