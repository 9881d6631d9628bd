"""Sending a call to its runtime, and what its failures mean: where a slot answers, the
request as the runtime gets it, a resend while Cloudflare propagates a script just placed, and
the contract's answer to a call the runtime timed out, lost, stopped at a limit or failed itself."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NoReturn

from urllib3.util import parse_url

from capabilities.books import routes
from capabilities.engine.calls import Call
from capabilities.engine.offload import Offload
from capabilities.engine.recording import Recorder, stop_under
from capabilities.engine.upstream import (
    HOP_BY_HOP,
    UpstreamClient,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from capabilities.engine.values import CallRequest
from capabilities.runtimes import runtime_for
from capabilities.runtimes.api_work import ApiClass, api_work
from capabilities.runtimes.base import Route, Runtime
from capabilities.runtimes.errors import RuntimeThrottled, RuntimeUnavailable
from capabilities.services.placement import runtime_throttled
from sigil.errors import CapabilityError, SigilError, Timeout, TooLarge, Unavailable, UpstreamError
from sigil.serving import switch_command

logger = logging.getLogger("capabilities.engine")

# What the engine drops from the caller's request besides hop-by-hop fields: the caller's
# credentials, the length it writes itself, and (below) anything posing as Sigil's internal
# headers. The caller's Host goes on (the capability's request.url names the host it was
# called at), unless the route names the host its runtime needs.
DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {"authorization", "content-length"}
# Cloudflare stopped the capability at its limits. Sigil's own Workers answer `exceeded-cpu`
# (with "ran past its CPU limit of N ms") when they see it; an unmarked 1102, which does not
# say whether CPU or memory ran out, is read as EXCEEDED_LIMITS (Runtime.stopped_at_limits).
EXCEEDED_CPU = "exceeded-cpu"
EXCEEDED_LIMITS = "exceeded-limits"
# The runtime failed on its own side, not the capability: Cloudflare's error page for it (an
# unmarked 5xx other than 1102: Runtime.failed_itself), or its "internal error" as Sigil's
# dispatch Worker met it. It counts toward no capability's breaker.
INTERNAL_ERROR = "internal-error"
# The longest wait a runtime's Retry-After is passed on with: beyond it, the caller is better
# told to come back soon and meet whatever the runtime says then.
MAX_RUNTIME_RETRY_AFTER_SECONDS = 300
# A path already as a request line may carry it: nothing to normalise.
SENDABLE_PATH = re.compile(r"[A-Za-z0-9/:@!$&'()*+,;=._~%-]*")
# How a call to a script it has just placed waits for Cloudflare to propagate it: the first
# pause, doubled after each "not found" up to the longest.
PROPAGATION_FIRST_PAUSE_SECONDS = 0.05
PROPAGATION_MAX_PAUSE_SECONDS = 1.0


@dataclass(slots=True, eq=False)
class Sender:
    """Sends the calls of one engine to their runtimes, one request each time."""

    runtime: Runtime  # the process's own: a route still on another is a switch under way
    upstream: UpstreamClient
    offload: Offload
    recorder: Recorder  # a call that timed out or was stopped at a limit is recorded as it fails
    max_body: int
    route_memo: dict[tuple, Route] = field(default_factory=dict)  # where each placement answers

    async def target(self, route: routes.CachedRoute) -> Route:
        """Where the route's slot answers, resolved once per placement: the route's own
        runtime (while `switchbackend` moves capabilities, some are still placed on the
        previous one, and are served there until their move is recorded)."""
        key = (route.backend, route.slot, route.sha, route.cpu_ms)
        target = self.route_memo.get(key)
        if target is None:
            runtime = runtime_for(route.backend)
            try:
                # No I/O but on a runtime's first call in a process (a Redis read of the account's
                # facts), or the first of every process (Cloudflare's account subdomain): a call
                # waiting on it, as on a page-in.
                with api_work(ApiClass.PAGE_IN, wait_seconds=self.upstream.read_timeout):
                    target = await self.offload(
                        runtime.route, slot=route.slot, sha=route.sha, tenant=route.agent, cpu_ms=route.cpu_ms
                    )
            except RuntimeThrottled as exc:  # no room in the API budget, while asked for the account's subdomain
                raise runtime_throttled(exc, doing=f"reach {route.slot}") from exc
            except RuntimeUnavailable as exc:
                raise self.runtime_failed(
                    route, f"the runtime could not say where slot {route.slot} answers: {exc}"
                ) from exc
            if len(self.route_memo) > 10_000:
                self.route_memo.clear()
            self.route_memo[key] = target
        return target

    def forget(self, route: routes.CachedRoute) -> None:
        """Resolve where the route's slot answers afresh on its next call: the runtime said it
        is not there (the runtime may have learnt since that the account's address changed)."""
        self.route_memo.pop((route.backend, route.slot, route.sha, route.cpu_ms), None)

    def upstream_request(self, request: CallRequest, target: Route) -> tuple[str, dict[str, str]]:
        """The URL and headers of the call as the runtime gets it."""
        headers = forwarded_headers(request)
        headers["x-request-id"] = request.request_id  # Sigil's, never the caller's
        headers.update(target.headers)
        if target.host_header:
            headers["host"] = target.host_header
        # Normalised as a client library would: dot segments resolved, characters that may
        # not appear in a request line percent-encoded.
        url = target.base_url + request.rest + ("?" + request.query if request.query else "")
        if request.query or "/." in request.rest or not SENDABLE_PATH.fullmatch(request.rest):
            parsed = parse_url(url)
            url = f"{parsed.scheme}://{parsed.netloc}{parsed.request_uri}"
        return url, headers

    async def send(self, request: CallRequest, target: Route) -> UpstreamResponse:
        url, headers = self.upstream_request(request, target)
        body: AsyncIterator[bytes] | bytes | None = None
        if request.length:
            headers["content-length"] = str(request.length)
            body = request.body
        elif request.chunked:
            body = limited_body(request.body, self.max_body)
        return await self.upstream.request(request.method, url, headers=headers, body=body)

    async def send_once(self, request: CallRequest, call: Call, route: routes.CachedRoute) -> UpstreamResponse:
        """The runtime's answer to one sending of the call. A timeout, or a stop at a limit of
        the call's own, is recorded as the call's failure and raised (Timeout, CapabilityError);
        a runtime out of reach is UpstreamError, a call cut by another's stop Unavailable."""
        call.sent_at = sent_at = time.time()
        try:
            return await self.send(request, await self.target(route))
        except UpstreamTimeout as exc:
            error = Timeout(f"{call.full} did not answer within {self.upstream.read_timeout:g} s")
            await self.recorder.finish(call, status=error.status, code=error.code, message=error.message)
            raise error from exc
        except UpstreamUnreachable as exc:
            stopped = await stop_under(route, sent_at)
            if stopped is None:
                raise self.runtime_failed(route, f"the runtime could not be reached for {call.full}: {exc}") from exc
            if not stopped.culprit:
                # Its process exited, or it shared one with a call that ran past a limit, or found
                # it restarting: not this capability's failure, so its breaker is left alone.
                alone = stopped.reason in ("exited", "starved")  # no call of the process caused it
                whose = "its runtime process" if alone else "another call in its runtime process"
                raise Unavailable(
                    f"{call.full} was interrupted: {whose} {stopped.message}; a fresh process is starting",
                    retry_after=1,
                ) from exc
            error = stopped_at_limit(call.full, stopped.message, cpu=stopped.reason == "cpu")
            await self.recorder.finish(call, status=error.status, code=error.code, message=error.message)
            raise error from exc

    async def resend_while_propagating(self, request, call: Call, route, upstream: UpstreamResponse):
        """Send a bodiless call again while the script this call just placed (or Sigil's own
        Worker in front of it, deployed by that placement) still answers "not found": Cloudflare
        serves a new Worker, and a workers.dev route just turned on, only once they have
        propagated. Backs off, within the call's time (SIGIL_INVOKE_TIMEOUT_SECONDS); the last
        answer is the caller's. Nothing ran the capability's code meanwhile, so resending is safe."""
        runtime = runtime_for(route.backend)
        deadline = call.started + self.upstream.read_timeout
        pause = PROPAGATION_FIRST_PAUSE_SECONDS
        while time.perf_counter() + pause < deadline:
            await upstream.drain()
            upstream.release()
            await asyncio.sleep(pause)
            pause = min(pause * 2, PROPAGATION_MAX_PAUSE_SECONDS)
            upstream = await self.send_once(request, call, route)
            if not (upstream.status == 404 and runtime.is_missing(upstream)):
                break
        return upstream

    def runtime_failed(self, route: routes.CachedRoute, message: str) -> UpstreamError:
        """The 502 for a runtime that failed a call; a capability still placed on the runtime
        used before SIGIL_BACKEND changed is told how it is moved."""
        if route.backend and route.backend != self.runtime.name:
            message += (
                f" (it is still placed on the {route.backend} runtime, not {self.runtime.name}: "
                f"the owner moves it with `{switch_command(self.runtime.name)}`)"
            )
        return UpstreamError(message)

    async def runtime_failure(self, upstream: UpstreamResponse, failure: str, call: Call) -> NoReturn:
        """Raise the contract's error for an answer the runtime marked as its own failure
        (`x-sigil-error`, a stop at the limits, or its own side failing): the capability's own
        doing (it threw, or ran past a limit) is recorded as its failure; anything else is the
        runtime's, recorded as no capability's."""
        message = (await upstream.read()).decode(errors="replace")[:2000]
        upstream.release()
        if failure == INTERNAL_ERROR:
            logger.warning("the runtime failed a call to %s itself: %s %s", call.full, upstream.status, message[:300])
            error = runtime_failed_itself(call.full, upstream.status, upstream.headers.get("retry-after"))
        elif failure == "exception":
            thrown = _exception_text(message)
            error: SigilError = CapabilityError(f"{call.full} threw: {thrown}")
            await self.recorder.finish(call, status=error.status, code=error.code, message=thrown)
        elif failure in (EXCEEDED_CPU, EXCEEDED_LIMITS):
            # The capability's own doing: it counts toward its breaker, and no other's. Worded
            # and classed as the local runtime's stops are: 504 for CPU, else 502.
            if failure == EXCEEDED_CPU:
                error = stopped_at_limit(call.full, _runtime_message(message, "ran past its CPU limit"), cpu=True)
            else:
                error = stopped_at_limit(call.full, "ran past its resource limits (CPU time or memory)", cpu=False)
            await self.recorder.finish(call, status=error.status, code=error.code, message=error.message)
        else:
            logger.error("runtime refused a call to %s: %s %s", call.full, failure, message)
            error = UpstreamError(f"the runtime failed to run {call.full} ({failure})")
        raise error  # answered by Engine.call(), which logs and counts it with its code


def forwarded_headers(request: CallRequest) -> dict[str, str]:
    """The caller's headers the capability gets: not its credentials, nor hop-by-hop fields,
    nor anything posing as Sigil's own (x-sigil-*)."""
    return {
        name: value
        for name, value in request.headers.items()
        if name not in DROPPED_REQUEST_HEADERS and not name.startswith("x-sigil-")
    }


def runtime_failed_itself(full: str, status: int, retry_after: str | None) -> SigilError:
    """The answer to a call the runtime failed on its own side: `503 unavailable` when it said
    when to try again (Cloudflare's Retry-After, on the 5xx it deems retryable), else
    `502 upstream_error`. Neither is the capability's failure."""
    seconds = int(retry_after) if retry_after is not None and retry_after.strip().isdigit() else None
    if seconds is not None:
        seconds = min(max(seconds, 1), MAX_RUNTIME_RETRY_AFTER_SECONDS)
        return Unavailable(
            f"the runtime failed to run {full} on its own side ({status}); try again in {seconds} s",
            retry_after=seconds,
        )
    return UpstreamError(f"the runtime failed to run {full} on its own side ({status})")


def stopped_at_limit(full: str, what: str, *, cpu: bool) -> SigilError:
    """The answer to a call its runtime stopped at a limit, alike on every runtime: 504 for
    CPU time, 502 otherwise (memory, or a limit Cloudflare does not name)."""
    message = f"{full} {what} and was stopped"
    return Timeout(message) if cpu else CapabilityError(message)


async def limited_body(body: AsyncIterator[bytes] | bytes, limit: int) -> AsyncIterator[bytes]:
    """A chunked body passed on as it arrives, cut with TooLarge past `limit`."""
    if isinstance(body, bytes):
        body = _once(body)
    size = 0
    async for chunk in body:
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body is over {limit} bytes")
        yield chunk


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _runtime_message(body: str, fallback: str) -> str:
    """The message of a refusal of Sigil's own Worker (`{"error": …, "message": …}`)."""
    try:
        message = json.loads(body)["message"]
    except (ValueError, KeyError, TypeError):
        return fallback
    return message[:200] if isinstance(message, str) else fallback


def _exception_text(host_message: str) -> str:
    try:
        return json.loads(host_message)["message"].splitlines()[0][:500]
    except (ValueError, KeyError, IndexError, TypeError):
        return host_message[:500]
