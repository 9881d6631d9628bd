"""Questions to the loader host (host/host.js) about placed code: does it start, and release it.

Cloudflare runs a script's top-level code when it is uploaded and refuses one that does not
start (error 10021). Code the loader host runs (the local and loader runtimes, and the
emulator's scripts) is never uploaded as a script, so the host is asked the same question
before a placement is made: it starts the code under the loader id calls will use, without
calling any of its handlers.

The host keeps the isolates of a slot's two latest versions and retires older ones itself;
a removed slot's isolate is retired on request.
"""

from __future__ import annotations

import json

import urllib3

from capabilities.runtimes.base import Route
from capabilities.runtimes.errors import RuntimeRejected, RuntimeUnavailable, network_failure

START_CHECK_HEADER = "X-Sigil-Validate"
RETIRE_HEADER = "X-Sigil-Retire"
STORE_HEADER = "X-Sigil-Store"


def _ask_host(
    pool: urllib3.PoolManager, route: Route, header: str, what: str, body: bytes | None = None
) -> urllib3.BaseHTTPResponse:
    """POST to the loader host behind `route` with the control `header` set. Raises
    RuntimeUnavailable when the host cannot be reached."""
    headers = {**dict(route.headers), header: "1"}
    if route.host_header:
        headers["Host"] = route.host_header
    try:
        return pool.request("POST", route.base_url + "/", headers=headers, body=body)
    except urllib3.exceptions.HTTPError as exc:
        raise RuntimeUnavailable(f"the loader host could not be asked to {what}: {network_failure(exc)}") from exc


class HostNotReached(RuntimeUnavailable):
    """The answer did not come from the loader host: a Worker of that name is not served
    there (yet; Cloudflare serves a new Worker once it has propagated)."""


def loader_host_start_check(pool: urllib3.PoolManager, route: Route) -> bool:
    """Start the code behind `route` on its loader host. Returns True when it started, False
    when the host does not see the code yet (Workers KV is eventually consistent).

    Raises RuntimeRejected with workerd's own words (a syntax error, an exception thrown by
    top-level code), HostNotReached when the answer is not the host's (a 404 it did not
    mark), RuntimeUnavailable when the host cannot be asked or cannot tell.
    """
    response = _ask_host(pool, route, START_CHECK_HEADER, "start the code")
    if response.status == 204:
        return True
    kind = response.headers.get("x-sigil-error")
    if response.status == 404 and kind == "missing-code":
        return False
    if response.status == 400 and kind == "invalid-code":
        raise RuntimeRejected(_message(response.data))
    if response.status == 404 and kind is None:
        raise HostNotReached("the loader host was not reached for the start check (404, unmarked)")
    raise RuntimeUnavailable(f"the loader host answered the start check with {response.status} ({kind or 'unmarked'})")


def loader_host_retire(pool: urllib3.PoolManager, route: Route) -> None:
    """Have the host release the isolate it runs for `route`'s loader id, once the calls in it
    end; a later call would load the code again. Idempotent: releasing what is not loaded does
    nothing.

    Raises RuntimeUnavailable when the host cannot be asked.
    """
    response = _ask_host(pool, route, RETIRE_HEADER, "release the code")
    if response.status != 204:
        kind = response.headers.get("x-sigil-error")
        raise RuntimeUnavailable(f"the loader host answered the release with {response.status} ({kind or 'unmarked'})")


def loader_host_store(pool: urllib3.PoolManager, route: Route, stored: bytes) -> None:
    """Have the host write the stored bundle `stored` (`CodeBundle.to_json`) for `route`'s
    sha through its own Workers KV binding, where its own reads see it at once. Idempotent.

    Raises RuntimeUnavailable when the host cannot be asked or does not store it.
    """
    response = _ask_host(pool, route, STORE_HEADER, "store the code", body=stored)
    if response.status != 204:
        kind = response.headers.get("x-sigil-error")
        raise RuntimeUnavailable(f"the loader host answered the store with {response.status} ({kind or 'unmarked'})")


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["message"]).strip()
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace").strip()
