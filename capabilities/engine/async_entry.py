"""The asynchronous calls' way in: a call sent with `Prefer: respond-async` is kept for the
runners (capabilities/engine/runner.py) and answered `202 Accepted` with where its result will
be (capabilities/services/async_calls.py). The runner later gives the engine the call back as a
CallRequest with `accepted_token_hash`, run as the caller who sent it."""

from __future__ import annotations

import json

from django.conf import settings

from capabilities.engine.admission import Admitted
from capabilities.engine.answers import NOSNIFF
from capabilities.engine.offload import Offload
from capabilities.engine.sending import forwarded_headers, limited_body
from capabilities.engine.values import CallAnswer, CallRequest
from capabilities.services.async_calls import async_call_accept
from sigil.errors import InvalidRequest, TooLarge


def prefers_async(request: CallRequest) -> bool:
    return not request.websocket and "respond-async" in request.headers.get("prefer", "")


class AsyncEntry:
    """Accepts the asynchronous calls of one engine."""

    def __init__(self, offload: Offload) -> None:
        self.offload = offload
        self.max_body = settings.SIGIL_ASYNC_MAX_BODY_BYTES

    async def accept(self, admitted: Admitted) -> CallAnswer:
        """Keep the admitted call and answer 202; refuses now a body over
        SIGIL_ASYNC_MAX_BODY_BYTES (TooLarge), a body cut short (InvalidRequest)."""
        request, full = admitted.request, admitted.full
        headers = forwarded_headers(request)
        callback_url = headers.pop("x-callback-url", None)
        headers.pop("prefer", None)  # both were addressed to Sigil
        if request.length and request.length > self.max_body:
            raise TooLarge(f"the request body of an asynchronous call is over {self.max_body} bytes")
        body = await read_body(request, self.max_body) if request.has_body else b""
        if request.length and len(body) < request.length:
            raise InvalidRequest("the request body ended before its Content-Length")
        accepted = await self.offload(
            async_call_accept,
            caller=admitted.principal.agent_name,
            full=full,
            token_hash=admitted.token_hash,
            method=request.method,
            rest=request.rest,
            query=request.query,
            headers=headers,
            body=body,
            callback_url=callback_url,
            request_id=request.request_id,
        )
        document = json.dumps(
            {
                "status": "accepted",
                "callback": accepted.status_url,
                "eta_seconds": accepted.eta_seconds,
                "call": accepted.call_id,
                "capability": full,
                "status_url": accepted.status_url,
            }
        ).encode()
        headers_out = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(document))),
            ("Location", accepted.status_url),
            ("Preference-Applied", "respond-async"),
            NOSNIFF,
        ]
        return CallAnswer(202, "Accepted", headers_out, document)


async def read_body(request: CallRequest, limit: int) -> bytes:
    """The whole request body, at most `limit` bytes. Raises TooLarge."""
    return b"".join([chunk async for chunk in limited_body(request.body, limit)])
