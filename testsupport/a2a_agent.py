"""An A2A agent on loopback, built with the official A2A SDK's server (JSON-RPC over HTTP,
its Agent Card at the well-known path): it keeps every message it is sent and answers each
with a short message of its own. It can refuse the first few with 503 to exercise retries."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from a2a.helpers.proto_helpers import get_data_parts, get_text_parts, new_text_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette
from starlette.responses import Response

from sigil.ports import free_port

RPC_PATH = "/a2a"


class _Recorder(AgentExecutor):
    def __init__(self, received: list[dict]) -> None:
        self.received = received

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        self.received.append(
            {
                "message_id": message.message_id,
                "text": "\n".join(get_text_parts(message.parts)),
                "data": [_plain(d) for d in get_data_parts(message.parts)],
                "raw": MessageToDict(message),
            }
        )
        await event_queue.enqueue_event(new_text_message("noted", context_id=context.context_id))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise NotImplementedError


def _plain(value):
    """google.protobuf.Value stores every number as a double: whole ones read back as ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class A2aAgent:
    """The agent, served by uvicorn in a thread on 127.0.0.1 until `stop`."""

    def __init__(self, *, fail_first: int = 0) -> None:
        self.port = free_port()
        self.received: list[dict] = []
        self.fail_first = fail_first
        self.refused = 0
        card = AgentCard(
            name="alerts-listener",
            description="Keeps what Sigil tells it.",
            version="1.0.0",
            supported_interfaces=[
                AgentInterface(protocol_binding="JSONRPC", protocol_version="1.0", url=f"{self.base_url}{RPC_PATH}")
            ],
            capabilities=AgentCapabilities(streaming=False),
            default_input_modes=["text/plain", "application/json"],
            default_output_modes=["text/plain"],
            skills=[AgentSkill(id="listen", name="listen", description="Takes alerts.", tags=["alerts"])],
        )
        handler = DefaultRequestHandler(
            agent_executor=_Recorder(self.received), task_store=InMemoryTaskStore(), agent_card=card
        )
        routes = Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, RPC_PATH)])

        async def app(scope, receive, send):
            if scope["type"] == "http" and scope["path"] == RPC_PATH and self.refused < self.fail_first:
                self.refused += 1
                await Response(json.dumps({"error": "busy"}), status_code=503)(scope, receive, send)
                return
            await routes(scope, receive, send)

        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True, name="a2a")
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the A2A agent did not start")
            time.sleep(0.02)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def card_url(self) -> str:
        return f"{self.base_url}/.well-known/agent-card.json"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
