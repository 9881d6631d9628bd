"""A script's call, sent on to the workerd process that runs it and relayed back as it comes.

The request handler's (`cfemulator.handler`) half for the hosts `{script}.{sub}.workers.dev`
and `{script}.{namespace}.dispatch.localhost`: the body streams both ways, a WebSocket upgrade
becomes a byte relay (`cfemulator.tunnel`), a call that runs past its CPU or memory limit
is answered with Cloudflare's error 1102 (`cfemulator.limits`), and one the emulator itself
fails with Cloudflare's own 500 (`cfemulator.errorpages`). A call of a Worker Loader's
Dynamic Worker (DYNAMIC_CALL_HEADER, from its loader Worker's binding) goes the same way to
the Dynamic Worker's own process (`cfemulator.dynamic`); past a limit, or failed by the
emulator itself, the binding is told (EXCEEDED_HEADER, INTERNAL_ERROR_HEADER) and its
`fetch()` throws what Cloudflare's runtime throws.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

import urllib3
from urllib3 import HTTPHeaderDict

from cfemulator.api import WorkerTarget
from cfemulator.bodies import PIECE, BodyTooLarge, RequestBody
from cfemulator.bound import (
    DYNAMIC_CALL_HEADER,
    DYNAMIC_ENTRYPOINT_HEADER,
    DYNAMIC_HEADER_PREFIX,
    EXCEEDED_HEADER,
    INTERNAL_ERROR_HEADER,
    LIMITS_HEADER,
    NOT_FOUND_HEADER,
    ORIGINAL_HOST_HEADER,
    SUBREQUEST_HEADER,
    has_worker_loader,
)
from cfemulator.dynamic import UnknownDynamicWorker
from cfemulator.errorpages import INTERNAL_ERROR, ErrorAnswer, error_answer
from cfemulator.hostcode import LOADER_ID_HEADER, SECRET_HEADER
from cfemulator.limits import WORKER_EXCEEDED, call_cpu_ms, exceeded_answer
from cfemulator.scripts import ScriptProcess
from cfemulator.timings import CallTimes, new_ray
from cfemulator.tunnel import UPGRADE_HEADERS, Handshake, HandshakeFailed, is_websocket_upgrade, relay

logger = logging.getLogger(__name__)

# RFC 9110 §7.6.1 connection-specific fields, and the length the emulator writes itself: it
# frames every body itself (a known length is passed on, anything else is chunked).
_CONNECTION_FIELDS = frozenset({"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"})
HOP_BY_HOP = _CONNECTION_FIELDS | {"proxy-authenticate", "proxy-authorization", "content-length"}
# The loader host's control headers: a caller's own never reach a script the host runs.
_HOST_HEADERS = frozenset(
    {"x-sigil-secret", "x-sigil-loader-id", "x-sigil-validate", "x-sigil-retire", "x-sigil-store", "x-sigil-cpu-ms"}
)
# Sent by the emulator itself on every answer; a Worker's own (or a nested emulator
# answer's, through a dispatch namespace) would repeat them.
OWN_HEADERS = frozenset({"content-type", "server", "date"})
_NOT_PASSED = HOP_BY_HOP | OWN_HEADERS
# What the emulator's loader host adds to the answer of a plain script it runs (its mark
# for Sigil's engine, capabilities/runtimes/host/host.js): on Cloudflare the script's
# answer reaches the caller as the script made it, so the mark is taken off again.
_LOADER_HOST_MARKS = frozenset({"x-sigil-host"})
# Cloudflare's answer to a Worker's fetch of another Worker on its account's own workers.dev
# zone without the global_fetch_strictly_public flag (Workers docs, "Errors and exceptions").
SAME_ZONE_STATUS = 404
SAME_ZONE_BODY = b"error code: 1042"
DISPATCH_SUFFIX = ".dispatch.localhost"


class LimitExceeded(Exception):
    """The call ran past a limit ("cpu" or "memory") and its script's process was stopped."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WorkerProxy:
    """How `cfemulator.handler.RequestHandler` serves a script's call (a mixin of it: the
    connection, its headers and `_send` are the handler's)."""

    def _serve_worker(self, host: str, split: Any, *, door: bool = False) -> None:
        """Serve a call of the Worker at `host`: named by the Host header, or by the path
        through the workers.dev door (`door`: the Worker then sees `host` as its Host)."""
        emulator = self.server.emulator
        if self.headers.get(SUBREQUEST_HEADER) == "private" and emulator.api.same_zone(host):
            # A Worker's own fetch of a Worker on the account's zone, without the flag that
            # sends it through the front door: Cloudflare refuses it (error 1042).
            self.close_connection = True  # its body, if any, is left unread
            self._send(SAME_ZONE_STATUS, SAME_ZONE_BODY, "text/plain; charset=UTF-8")
            return
        # The call is in flight on each process it reaches until its answer is relayed (a
        # WebSocket session's, until it ends): a replaced version drains before it is stopped.
        self._calls_held = contextlib.ExitStack()
        target = emulator.api.resolve_host(host)
        limits = self.headers.get(LIMITS_HEADER)
        if target is None:
            # The body is left unread, so the connection cannot be reused.
            self.close_connection = True
            # The reference does not say what a workers.dev host without a Worker answers;
            # a plain 404 is what a client can rely on. The header tells the emulator's
            # dispatch namespace binding to throw "Worker not found" instead.
            self._log_dispatch(host, limits, 404)  # before answering: whoever got the answer may read the log
            self._send(
                404,
                f"No Worker is served at {host}\n".encode(),
                "text/plain; charset=utf-8",
                [(NOT_FOUND_HEADER, "1")],
            )
            return
        try:
            body = RequestBody(self)
        except (BodyTooLarge, ValueError) as exc:
            self._refuse_body(exc)
            return
        # Cloudflare hands a WebSocket request to the Worker with its upgrade; it has no body.
        upgrade = body.finished and is_websocket_upgrade(self.command, self.headers.get("Upgrade"))
        headers = HTTPHeaderDict()
        original_host = self.headers.get(ORIGINAL_HOST_HEADER)
        for name, value in self.headers.items():
            lower = name.lower()
            hop_by_hop = lower in HOP_BY_HOP and not (upgrade and lower in UPGRADE_HEADERS)
            emulators = lower in (LIMITS_HEADER, ORIGINAL_HOST_HEADER, SUBREQUEST_HEADER) or lower.startswith(
                DYNAMIC_HEADER_PREFIX
            )
            if hop_by_hop or emulators:
                continue
            if lower in ("cf-connecting-ip", "cf-ray") and not host.endswith(DISPATCH_SUFFIX):
                continue  # Cloudflare writes its own (below)
            if lower == "host" and (original_host or door):
                value = original_host or host
            # A script run by the loader host must not be reachable with a caller's own secret
            # or loader id; a bound script runs alone and gets every header, as on Cloudflare.
            if lower in _HOST_HEADERS and not target.runs_bound:
                continue
            headers.add(name, value)
        if not host.endswith(DISPATCH_SUFFIX):
            # Cloudflare names the address its front door was called from on every request to a
            # Worker (a dispatch namespace's script gets its dispatch Worker's request as it is).
            headers["CF-Connecting-IP"] = self.client_address[0]
        # Every request to a Worker has a ray id; the call's trace names it (cfemulator.timings).
        ray = headers.get("CF-Ray") or new_ray()
        headers["CF-Ray"] = ray
        if body.length:  # urllib3 frames an empty one as the method expects
            headers["Content-Length"] = str(body.length)
        if not target.runs_bound:
            headers[SECRET_HEADER] = emulator.scripts.secret
            headers[LOADER_ID_HEADER] = f"{target.name}@{target.sha}"
        elif has_worker_loader(target.upload):
            emulator.dynamic.prepare()  # a spare process for its next new Dynamic Worker
        path = split.path + (f"?{split.query}" if split.query else "")
        limit_ms = call_cpu_ms(target.upload.limits, _parse_limits(limits), default=emulator.api.config.default_cpu_ms)

        def acquire() -> ScriptProcess:
            return self._hold_process(target)

        def send(port: int) -> Any:
            if upgrade:
                return emulator.upgrade(self.command, path, headers, port=port)
            return emulator.proxy(self.command, path, headers, body.pieces(), port=port)

        def answered(upstream: Any) -> None:
            self._log_dispatch(host, limits, upstream.status, target)
            if upgrade:
                self._pass_upgrade(upstream, unmark=not target.runs_bound)
            else:
                self._relay(upstream, unmark=not target.runs_bound)

        dispatched = host.endswith(".dispatch.localhost")

        def answer_for_cloudflare(answer: ErrorAnswer, mark: tuple[str, str]) -> None:
            # The dispatch namespace binding reads its mark and throws instead (cfemulator.bound).
            self._log_dispatch(host, limits, answer.status, target)
            self._send(answer.status, answer.body, answer.content_type, answer.headers + ([mark] if dispatched else []))

        traced = (target.key, ray) if target.tails else None
        try:
            self._run(acquire, limit_ms, body, send, answered, traced=traced)
        except LimitExceeded as exceeded:
            answer = exceeded_answer(host=original_host or host, accept=self.headers.get("Accept"))
            answer_for_cloudflare(answer, (EXCEEDED_HEADER, exceeded.reason))
        except BodyTooLarge:
            self._send(413, b"request body too large", "text/plain")
        except ValueError:
            self._send(400, b"malformed request body framing", "text/plain")
        except (urllib3.exceptions.HTTPError, HandshakeFailed, RuntimeError, TimeoutError) as exc:
            # The emulator's own failure (the script's workerd died under the call, or could
            # not be started): Cloudflare's side failing, which it answers with its 500.
            logger.warning("workerd failed a call to %s: %s", target.name, exc)
            answer = error_answer(INTERNAL_ERROR, host=original_host or host, accept=self.headers.get("Accept"))
            answer_for_cloudflare(answer, (INTERNAL_ERROR_HEADER, "1"))
        finally:
            self._calls_held.close()
            if not body.finished:
                # What the script did not read is still on the socket: the next request
                # on it could not be told from it.
                self.close_connection = True

    def _serve_dynamic(self, split: Any) -> None:
        """One call of a Dynamic Worker from its loader Worker's binding (cfemulator.bound), run
        in the Dynamic Worker's own process and metered against its own limit. Past it, the
        answer carries EXCEEDED_HEADER, for the binding to throw Cloudflare's error."""
        emulator = self.server.emulator
        key = self.headers.get(DYNAMIC_CALL_HEADER) or ""
        try:
            body = RequestBody(self)
        except (BodyTooLarge, ValueError) as exc:
            self._refuse_body(exc)
            return
        # A WebSocket upgrade reaches the Dynamic Worker with its upgrade, as a script's does.
        upgrade = body.finished and is_websocket_upgrade(self.command, self.headers.get("Upgrade"))
        headers = HTTPHeaderDict()
        for name, value in self.headers.items():
            lower = name.lower()
            if lower not in HOP_BY_HOP or (upgrade and lower in UPGRADE_HEADERS):
                headers.add(name, value)
        if body.length:
            headers["Content-Length"] = str(body.length)
        path = split.path + (f"?{split.query}" if split.query else "")

        def send(port: int) -> Any:
            if upgrade:
                return emulator.upgrade(self.command, path, headers, port=port)
            return emulator.proxy(self.command, path, headers, body.pieces(), port=port)

        def answered(upstream: Any) -> None:
            if upgrade:
                self._pass_upgrade(upstream)
            else:
                self._relay(upstream, as_sent=True)

        try:
            limit_ms = emulator.dynamic.cpu_ms(
                key,
                _entrypoint_limits(self.headers.get(DYNAMIC_ENTRYPOINT_HEADER)),
                default=emulator.api.config.default_cpu_ms,
            )
            # The request its loader Worker passed on, with that call's ray id, if any.
            ray = headers.get("CF-Ray")
            with emulator.dynamic.call(key) as acquire:
                self._run(acquire, limit_ms, body, send, answered, traced=(key, ray) if ray else None)
        except UnknownDynamicWorker:
            self.close_connection = not body.finished
            self._send(404, b"the emulator holds no such Dynamic Worker\n", "text/plain", [(NOT_FOUND_HEADER, "1")])
        except LimitExceeded as exceeded:
            reason = f"the Dynamic Worker ran past its {exceeded.reason} limit\n".encode()
            self._send(WORKER_EXCEEDED.status, reason, "text/plain", [(EXCEEDED_HEADER, exceeded.reason)])
        except BodyTooLarge:
            self._send(413, b"request body too large", "text/plain")
        except ValueError:
            self._send(400, b"malformed request body framing", "text/plain")
        except (urllib3.exceptions.HTTPError, HandshakeFailed, RuntimeError, TimeoutError) as exc:
            # The emulator's own failure: the binding throws what workerd throws for a failure
            # of the runtime itself (cfemulator.bound, INTERNAL_ERROR_HEADER).
            logger.warning("workerd failed a call of the Dynamic Worker %s: %s", key, exc)
            answer = error_answer(INTERNAL_ERROR, host=self.headers.get("Host") or "", accept=None)
            self._send(answer.status, answer.body, answer.content_type, [*answer.headers, (INTERNAL_ERROR_HEADER, "1")])
        finally:
            if not body.finished:
                self.close_connection = True

    def _run(
        self,
        acquire: Callable[[], ScriptProcess],
        limit_ms: int,
        body: RequestBody,
        send: Callable[[int], Any],
        answered: Callable[[Any], None],
        *,
        traced: tuple[str, str] | None = None,
    ) -> None:
        """Run one call in its own workerd (`acquire()` finds it, started): `send(port)` sends
        it there and returns the answer, which is metered against `limit_ms` of CPU until
        `answered` has relayed it (a streamed answer, or a WebSocket session, keeps it running).
        `traced`: the process key and ray id the call's times are noted under, for its trace
        (cfemulator.timings).

        Raises LimitExceeded when it ran past a limit before answering, RuntimeError when
        workerd cannot start, urllib3's errors or HandshakeFailed when workerd does not answer.
        """
        emulator = self.server.emulator
        restarted = False
        while True:
            running = acquire()
            pid = running.pid
            if pid is None:  # stopped between its start and now: it is being started again
                if not restarted:
                    restarted = True
                    continue
                raise RuntimeError("its workerd keeps stopping")
            sent_at, began, reached = time.time(), time.monotonic(), False
            try:
                with emulator.meter.call(
                    pid=pid, stop=running.stop_for_cpu, limit_ms=limit_ms, silent=running.silent
                ) as ticket:
                    try:
                        upstream = send(running.port)
                    except (urllib3.exceptions.HTTPError, HandshakeFailed) as exc:
                        if ticket.exceeded:
                            raise LimitExceeded("cpu") from None
                        reason = running.stopped_for(sent_at)
                        if reason is not None:
                            raise LimitExceeded(reason) from None
                        # Refused: the process was stopped (another call ran past a limit) before
                        # this one reached it. Nothing ran (no body was read), so it goes to the
                        # fresh one.
                        refused = isinstance(exc, urllib3.exceptions.NewConnectionError)
                        refused = refused or getattr(exc, "refused", False)
                        if not restarted and refused and not body.started:
                            restarted = True
                            continue
                        raise
                    reached = True
                    answered(upstream)
                    return
            finally:
                # Noted once the meter has charged the call's last CPU (on leaving it).
                if reached and traced is not None:
                    times = CallTimes(wall_ms=(time.monotonic() - began) * 1000, cpu_ms=ticket.used_ms)
                    emulator.timings.noted(*traced, times)

    def _hold_process(self, target: WorkerTarget) -> ScriptProcess:
        """The process that runs `target`, with this call in flight on it until the call's
        answer is relayed; a call sent again (to a fresh process) holds only the last."""
        held = contextlib.ExitStack()
        running = held.enter_context(
            self.server.emulator.scripts.calling(
                target.key, sha=target.sha, upload=target.upload, tails=target.tails, generation=target.generation
            )
        )
        self._calls_held.close()
        self._calls_held = held
        return running

    def _relay(self, upstream: urllib3.BaseHTTPResponse, *, unmark: bool = False, as_sent: bool = False) -> None:
        """Send workerd's answer on as it arrives: each chunk as workerd writes it; `unmark`
        takes off the headers the emulator's loader host added (a plain script's answer);
        `as_sent` adds none of the emulator's own (a Dynamic Worker's answer to its loader Worker).

        Once the status line is out, a failure can no longer be answered: the connection is
        closed before the body's end, which the client sees as a truncated answer (as a
        Worker that fails mid-stream is seen on Cloudflare).
        """
        headers = _unmarked(upstream.headers.items(), unmark=unmark)
        complete = False
        try:
            pieces = (
                upstream.read_chunked(decode_content=False)
                if upstream.chunked
                else upstream.stream(PIECE, decode_content=False)
            )
            self._send_streamed(upstream.status, headers, pieces, as_sent=as_sent)
            complete = True
        except urllib3.exceptions.HTTPError as exc:
            logger.warning("workerd's answer broke off: %s", exc)
        finally:
            if complete:
                upstream.release_conn()
            else:
                self.close_connection = True
                upstream.close()

    def _pass_upgrade(self, handshake: Handshake, *, unmark: bool = False) -> None:
        """Answer a WebSocket upgrade as workerd did: a 101 is passed on with its own head, and
        the connection becomes a byte relay until both sides hang up (`cfemulator.tunnel`);
        any other answer is relayed as an ordinary one. `unmark` as for `_relay`."""
        try:
            if not handshake.upgraded:
                try:
                    self._send_streamed(
                        handshake.status, _unmarked(handshake.headers(), unmark=unmark), handshake.pieces()
                    )
                except HandshakeFailed as exc:
                    logger.warning("workerd's answer broke off: %s", exc)
                    self.close_connection = True
                return
            self.close_connection = True  # the connection is the session's now
            self.send_response(handshake.status)
            for name, value in _unmarked(handshake.headers(), unmark=unmark):
                if name.lower() not in OWN_HEADERS:
                    self.send_header(name, value)
            self.end_headers()
            relay(self.connection, self.rfile, handshake)
        finally:
            handshake.close()

    def _send_streamed(
        self, status: int, headers: list[tuple[str, str]], pieces: Iterable[bytes], *, as_sent: bool = False
    ) -> None:
        """Send an answer whose body is `pieces`, each written as it comes: with the
        Content-Length given in `headers`, else chunked; with `as_sent`, with workerd's own
        headers only (no Server or Date of the emulator's). Raises what `pieces` raises."""
        passed = [
            (name, value) for name, value in headers if name.lower() not in (HOP_BY_HOP if as_sent else _NOT_PASSED)
        ]
        length = next((value for name, value in headers if name.lower() == "content-length"), None)
        content_type = next((value for name, value in headers if name.lower() == "content-type"), None)
        bodiless = self.command == "HEAD" or status in (204, 304)
        chunked = length is None and not bodiless
        if as_sent:
            self.log_request(status)
            self.send_response_only(status)
        else:
            self.send_response(status)
        if content_type and not as_sent:
            self.send_header("Content-Type", content_type)
        for name, value in passed:
            self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif length is not None:
            self.send_header("Content-Length", length)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if bodiless:
            return
        for piece in pieces:
            if not piece:
                continue
            if chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            else:
                self.wfile.write(piece)
            self.wfile.flush()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _log_dispatch(self, host: str, limits: str | None, status: int, target: WorkerTarget | None = None) -> None:
        """Calls through a dispatch namespace binding are logged with the limits they asked for."""
        if not host.endswith(".dispatch.localhost"):
            return
        parsed = _parse_limits(limits)
        script, _, rest = host.partition(".")
        namespace = target.namespace if target else rest.split(".", 1)[0]
        self.server.emulator.api.record_dispatch(namespace=namespace, script=script, limits=parsed, status=status)


def _unmarked(headers: Iterable[tuple[str, str]], *, unmark: bool) -> list[tuple[str, str]]:
    """`headers`, less the loader host's marks when `unmark` (a plain script's answer)."""
    return [(name, value) for name, value in headers if not (unmark and name.lower() in _LOADER_HOST_MARKS)]


def _entrypoint_limits(header: str | None) -> Any:
    """The `limits` a Dynamic Worker's entrypoint was given (DYNAMIC_ENTRYPOINT_HEADER), or None."""
    try:
        asked = json.loads(unquote(header or ""))
    except ValueError:
        return None
    return asked.get("limits") if isinstance(asked, dict) else None


def _parse_limits(header: str | None) -> Any:
    """A dispatch binding's limits as it sent them: JSON, else the raw text."""
    try:
        return json.loads(header) if header else None
    except ValueError:
        return header
