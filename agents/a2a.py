"""Alerts as A2A messages, sent with the official A2A Python SDK (`a2a-sdk`).

An agent that gives Sigil its Agent Card's URL receives each alert as one A2A message
(`SendMessage`): a text part saying what happened, and a data part holding the same
delivery the webhook carries (event, capability, request ids, where its call records are).
The card is resolved at each delivery, so an agent that moves its endpoint needs only to
update its card. Sigil's own code calls `a2a_send`; the SDK's client does the protocol.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
from a2a.client import A2ACardResolver, A2AClientError, AgentCardResolutionError, ClientConfig, ClientFactory
from a2a.helpers.proto_helpers import new_data_part, new_text_part
from a2a.types import Message, Role, SendMessageRequest

from agents import egress


class A2aUnavailable(Exception):
    """The agent's A2A endpoint did not answer, or answered 5xx: worth another try later."""


class A2aRefused(Exception):
    """The agent's card or endpoint refused the message for good (4xx, no usable card)."""


def a2a_send(*, card_url: str, text: str, data: dict, message_id: str, timeout: float = 10.0) -> str:
    """Resolve the Agent Card at `card_url` and send it one message; return what the agent
    answered with (a task's id and state, or "message"). Raises A2aUnavailable or A2aRefused.
    The message id is the delivery's, so an agent can tell a retried delivery from a new one."""
    return asyncio.run(_send(card_url=card_url, text=text, data=data, message_id=message_id, timeout=timeout))


async def _send(*, card_url: str, text: str, data: dict, message_id: str, timeout: float) -> str:
    parts = urlsplit(card_url)
    base = f"{parts.scheme}://{parts.netloc}"
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as http:
        try:
            card = await A2ACardResolver(http, base_url=base, agent_card_path=parts.path or "/").get_agent_card()
        except AgentCardResolutionError as exc:
            if exc.status_code is None or exc.status_code >= 500:
                raise A2aUnavailable(f"{card_url}: {exc.message}") from exc
            raise A2aRefused(f"{card_url}: {exc.message}") from exc
        except httpx.HTTPError as exc:
            raise A2aUnavailable(f"{card_url}: {exc.__class__.__name__}") from exc
        for interface in card.supported_interfaces:
            # The card names where messages go: an agent may not point Sigil at its own network.
            try:
                refusal = egress.callback_refusal(interface.url, resolve=True)
            except OSError as exc:
                raise A2aUnavailable(f"{interface.url}: cannot resolve its host ({exc})") from exc
            if refusal:
                raise A2aRefused(refusal.replace("X-Callback-Url", "the endpoint the Agent Card names"))
        client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
        message = Message(
            role=Role.ROLE_USER,
            message_id=message_id,
            parts=[new_text_part(text), new_data_part(data, media_type="application/json")],
        )
        answered = "message"
        try:
            async for response in client.send_message(SendMessageRequest(message=message)):
                if response.HasField("task"):
                    answered = f"task {response.task.id}"
                break
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code >= 500:
                raise A2aUnavailable(f"{card_url}: the endpoint answered {exc.response.status_code}") from exc
            raise A2aRefused(f"{card_url}: the endpoint answered {exc.response.status_code}") from exc
        except (httpx.TransportError, A2AClientError) as exc:
            # The SDK wraps transport failures in its own errors: none says "never again".
            raise A2aUnavailable(f"{card_url}: {exc}") from exc
        finally:
            await client.close()
        return answered
