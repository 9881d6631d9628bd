"""The emulated Cloudflare account and the REST endpoints Sigil uses, as the reference describes them.

Covered: verifying the API token, Worker scripts (upload, delete, list, settings), the
workers.dev subdomain (account and per script), Workers for Platforms dispatch namespaces and
their scripts, Workers KV namespaces and values. With Cloudflare's envelope, error codes,
script quota, size limit and rate limit (a 429 with code 971 locks the token out for the rest
of the window), plus injected latency and faults. Anything else answers 7003, as an unknown route does.

Uploaded bundles are written to `code_dir` as `{sha}.json` (the loader host's format, with
secret_text values sealed for the emulator's workerd as Sigil seals its own), so each
script's workerd runs them (`cfemulator.scripts`); `resolve_host` maps a workers.dev Host to
the script it runs. Scripts binding KV, a Worker Loader or a dispatch namespace run from a
config of their own (`cfemulator.bound`), whose KV reads and writes `kv_binding` serves from
this account.

One module per concern: this one holds the account (control, routing, lock-out, the code
store); the endpoints are in `api_scripts`, `api_namespaces` and `api_kv`, what they share
in `api_common`, and the account's records (scripts, namespaces, KV values) in `state`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from capabilities.runtimes.base import SECRET_KIND, CodeBundle, secret_fingerprint
from capabilities.workerd import write_atomically
from cfemulator.api_common import (
    _LABEL,
    ApiRequest,
    ApiResponse,
    _error_response,
    _fault_response,
    _now,
    _ok,
    _same,
)
from cfemulator.api_kv import KvEndpoints
from cfemulator.api_namespaces import NamespaceEndpoints
from cfemulator.api_scripts import ScriptEndpoints
from cfemulator.bound import kv_list_body, needs_own_workerd
from cfemulator.envelope import ApiError
from cfemulator.limits import DEFAULT_CPU_MS, MAX_CPU_MS

# The account's records live in state.py; named here too, as earlier saved states name them.
from cfemulator.state import (
    AccountState,
    DispatchNamespace,
    KvNamespace,
    KvValue,
    Script,
    load_state,
    save_state,
)
from cfemulator.uploads import ScriptUpload, parse_upload

logger = logging.getLogger(__name__)

API_PREFIX = "/client/v4"
# Credentials the emulator accepts when none are configured (CF_API_TOKEN, CF_ACCOUNT_ID).
DEV_TOKEN = "sigil-emulator-dev-token"
DEV_ACCOUNT_ID = "5169110000000000000000000000e001"
# Cloudflare's schema pattern (§1.5) with the documented 63-character bound of a DNS label.
# How many API calls the request log keeps; enough for any test, bounded for long dev runs.
_LOG_SIZE = 10_000
# Bodies above this are refused before they are read (Cloudflare's request limit).
MAX_BODY_BYTES = 100 * 1024 * 1024
PLANS = frozenset({"free", "paid"})
# Worker scripts an account may hold on each plan (reference §7.3): changing the plan sets
# `script_limit` to its plan's unless the same change sets it.
PLAN_SCRIPT_LIMITS = {"free": 100, "paid": 500}


@dataclass(frozen=True)
class EmulatorConfig:
    """What a test (or `manage.py cfemulator`) may change while the emulator runs."""

    script_limit: int = 500
    latency: float = 0.0
    fault_rate: float = 0.0
    fault_seed: int | None = None
    # Fail exactly the next N API calls with a 5xx (deterministic fault injection).
    fail_next: int = 0
    rate_limit: int = 1200
    rate_window: float = 300.0
    # Cloudflare's Paid plan limit, measured after compression (reference §7.3).
    script_max_bytes: int = 10 * 1024 * 1024
    subdomain: str = "sigil-emulator"
    # The CPU limit of a call to a script that sets none: the Paid plan's 30 s (Free: 10 ms).
    default_cpu_ms: int = DEFAULT_CPU_MS
    # CPU ms a call may use past its limit before it is stopped (see cfemulator.cpumeter).
    cpu_grace_ms: int = 100
    # The account's plan: "paid" (Workers Paid) or "free". Dynamic Worker Loader needs Paid.
    plan: str = "paid"
    # Whether the account subscribes to Workers for Platforms (dispatch namespaces).
    workers_for_platforms: bool = True
    # The code of the 404 for a missing dispatch namespace. No public source gives the real
    # one, so tests run the client against 10007 and against another code.
    namespace_not_found_code: int = 10007
    # Seconds before a change reaches the Workers runtime, as Cloudflare's propagation: a new
    # script (its API calls answer 10007 and its URL 404 until then), a workers.dev toggle,
    # a KV value written over the API (bindings read the one before). 0: at once.
    propagation_delay: float = 0.0
    # Seconds a Worker's KV read that found nothing keeps answering "not found" at its
    # location, even once the key is written over the API: Cloudflare caches a miss for the
    # read's cacheTtl, 60 s by default (KV docs, "How KV works"). A write through the binding
    # itself is seen at once where it was made. 0: misses are not cached.
    kv_miss_cache_seconds: float = 60.0
    # Answer a successful DELETE with 200 and no body at all, as some of Cloudflare's
    # endpoints are documented to ("This call has no response body on a successful delete"),
    # instead of the envelope with a null result.
    empty_delete_answers: bool = False

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["rate_limit"] = f"{self.rate_limit}/{self.rate_window:g}"
        del data["rate_window"]
        return data

    def updated(self, changes: dict[str, Any]) -> EmulatorConfig:
        """A copy with `changes` applied (keys as in `to_json`). Raises ValueError."""
        known = {f.name for f in fields(self)} - {"rate_window"}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for key, value in changes.items():
            if key == "rate_limit":
                values["rate_limit"], values["rate_window"] = parse_rate_limit(str(value))
            elif key in ("script_limit", "fail_next", "script_max_bytes", "cpu_grace_ms", "namespace_not_found_code"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{key} must be a whole number, at least 0")
                values[key] = value
            elif key == "default_cpu_ms":
                if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_CPU_MS:
                    raise ValueError(f"default_cpu_ms is a whole number of ms, 1 to {MAX_CPU_MS}")
                values[key] = value
            elif key in ("latency", "fault_rate", "propagation_delay", "kv_miss_cache_seconds"):
                if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{key} must be a number, at least 0")
                if key == "fault_rate" and value > 1:
                    raise ValueError("fault_rate is a fraction, between 0 and 1")
                values[key] = float(value)
            elif key == "fault_seed":
                if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                    raise ValueError("fault_seed must be a whole number or null")
                values[key] = value
            elif key == "plan":
                if value not in PLANS:
                    raise ValueError(f"plan is one of {sorted(PLANS)}")
                values[key] = value
                if "script_limit" not in changes:
                    values["script_limit"] = PLAN_SCRIPT_LIMITS[value]
            elif key in ("workers_for_platforms", "empty_delete_answers"):
                if not isinstance(value, bool):
                    raise ValueError(f"{key} is true or false")
                values[key] = value
            elif key == "subdomain":
                if not isinstance(value, str) or (value and not re.fullmatch(_LABEL, value)):
                    raise ValueError("subdomain must be one lowercase DNS label, or empty for none")
                values[key] = value
        return replace(self, **values)


def parse_rate_limit(text: str) -> tuple[int, float]:
    """`"1200/300"` -> (1200, 300.0): requests per window of seconds. Raises ValueError."""
    count, _, window = text.partition("/")
    try:
        limit, seconds = int(count), float(window)
    except ValueError:
        raise ValueError(f"a rate limit is REQUESTS/SECONDS, like 1200/300, not {text!r}") from None
    if limit < 1 or seconds <= 0:
        raise ValueError(f"a rate limit needs at least 1 request in a positive window, not {text!r}")
    return limit, seconds


class LockoutWindow:
    """Cloudflare's API rate limit: over `limit` calls in `window` s blocks every call for `window` s."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit
        self.window = window
        self._calls: deque[float] = deque()
        self._blocked_until = 0.0

    def admit(self, now: float) -> float | None:
        """Count one call; None when it may proceed, else the seconds until the lockout ends."""
        if now < self._blocked_until:
            return self._blocked_until - now
        while self._calls and self._calls[0] <= now - self.window:
            self._calls.popleft()
        if len(self._calls) >= self.limit:
            self._blocked_until = now + self.window
            return self.window
        self._calls.append(now)
        return None

    def headers(self, now: float) -> list[tuple[str, str]]:
        """The `Ratelimit` headers Cloudflare sends on every response (reference §7.2)."""
        remaining = max(0, self.limit - len(self._calls))
        reset = self._calls[0] + self.window - now if self._calls else self.window
        return [
            ("Ratelimit", f'"default";r={remaining};t={max(0, math.ceil(reset))}'),
            ("Ratelimit-Policy", f'"default";q={self.limit};w={self.window:g}'),
        ]


Handler = Callable[[ApiRequest, dict[str, str]], ApiResponse]


@dataclass(frozen=True)
class WorkerTarget:
    """The script a Worker request runs: an account script, or one in a dispatch namespace."""

    key: str  # "script:{name}" or "ns:{namespace}:{name}": one workerd process per key
    name: str
    sha: str
    upload: ScriptUpload
    namespace: str | None = None

    @property
    def runs_bound(self) -> bool:
        """Whether it needs a workerd config of its own for its bindings (see cfemulator.bound)."""
        return needs_own_workerd(self.upload)


class CloudflareApi(ScriptEndpoints, NamespaceEndpoints, KvEndpoints):
    """One emulated account: its state, its endpoints, and the emulator's control operations.

    Thread-safe: every read and change of the state holds one lock; latency is slept and
    uploads are parsed outside it.
    """

    def __init__(
        self,
        *,
        token: str,
        account_id: str,
        code_dir: Path,
        config: EmulatorConfig,
        seal_key: str,
        start_check: Callable[[str], str | None] | None = None,
        state_file: Path | None = None,
    ) -> None:
        self.account_id = account_id
        # The secret of the loader host that runs the uploaded scripts: secret_text values
        # are sealed for it on disk, as Cloudflare keeps them encrypted at rest.
        self._seal_key = seal_key
        # Given a loader id, starts that code on the loader host: None when it starts, else
        # why not. Cloudflare refuses a script that does not start at upload (10021).
        self._start_check = start_check
        self.code_dir = Path(code_dir)
        self.code_dir.mkdir(parents=True, exist_ok=True)
        self._token = token
        self._initial_config = config
        self._lock = threading.RLock()
        self._routes = self._route_table()
        self._state_file: Path | None = None  # not saved while the start state is set up
        self._reset_locked()
        if state_file is not None:
            self._restore(state_file)
            self._state_file = state_file

    # --- control (/__emulator/...) ------------------------------------------------------------

    @property
    def config(self) -> EmulatorConfig:
        return self._config

    def reset(self) -> None:
        """Forget every script, namespace, KV value, counter and logged call; restore the start config."""
        with self._lock:
            self._reset_locked()

    def _reset_locked(self) -> None:
        self._config = self._initial_config
        self.subdomain = self._config.subdomain
        self.scripts: dict[str, Script] = {}
        self.namespaces: dict[str, DispatchNamespace] = {}
        self.kv_namespaces: dict[str, KvNamespace] = {}
        self._log: deque[dict[str, Any]] = deque(maxlen=_LOG_SIZE)
        self._dispatches: deque[dict[str, Any]] = deque(maxlen=_LOG_SIZE)
        self._limiter = LockoutWindow(self._config.rate_limit, self._config.rate_window)
        self._faults = random.Random(self._config.fault_seed)
        self._fault_count = 0
        # (namespace id, key) -> until when a binding's read of it answers "not found" (see
        # EmulatorConfig.kv_miss_cache_seconds). A cache, not state: a restart forgets it.
        self._kv_misses: dict[tuple[str, str], float] = {}
        for path in self.code_dir.glob("*.json"):
            path.unlink(missing_ok=True)
        self._save_locked()

    def _restore(self, state_file: Path) -> None:
        """Take up the account as it was saved in `state_file`, if it was.

        Each script's bundle is written again: the code directory was emptied, and
        secret_text values are sealed for this run's workerd, whose key is new.
        """
        state = load_state(state_file)
        if state is None:
            return
        with self._lock:
            self.subdomain = state.subdomain
            self.scripts, self.namespaces, self.kv_namespaces = state.scripts, state.namespaces, state.kv_namespaces
            for script in [
                *self.scripts.values(),
                *(s for ns in self.namespaces.values() for s in ns.scripts.values()),
            ]:
                script.sha = self._write_bundle(script.upload)

    def _save_locked(self) -> None:
        """Save the account's state, when it is kept on disk (after each change, lock held)."""
        if self._state_file is not None:
            save_state(
                self._state_file,
                AccountState(
                    subdomain=self.subdomain,
                    scripts=self.scripts,
                    namespaces=self.namespaces,
                    kv_namespaces=self.kv_namespaces,
                ),
            )

    def configure(self, changes: dict[str, Any]) -> EmulatorConfig:
        """Change the running config. Raises ValueError for unknown keys or bad values."""
        with self._lock:
            config = self._config.updated(changes)
            if "rate_limit" in changes:
                self._limiter = LockoutWindow(config.rate_limit, config.rate_window)
            if "fault_seed" in changes:
                # Reseeding replays the same faults, in the same order of statuses.
                self._faults = random.Random(config.fault_seed)
                self._fault_count = 0
            if "subdomain" in changes:
                self.subdomain = config.subdomain
            self._config = config
            return config

    def request_log(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._log)

    def resolve_host(self, host: str) -> WorkerTarget | None:
        """The script a request for `host` runs, or None when nothing is served there.

        `{script}.{subdomain}.workers.dev` reaches an account script once its workers.dev
        URL is enabled. `{script}.{namespace}.dispatch.localhost` reaches a script in a
        dispatch namespace directly: it is what the emulator's dispatch namespace binding
        calls (see cfemulator.bound), and lets tests call a namespace script by name.
        """
        name = host.split(":", 1)[0].lower().rstrip(".")
        with self._lock:
            if self.subdomain:
                suffix = f".{self.subdomain}.workers.dev"
                if name.endswith(suffix):
                    script = self.scripts.get(name[: -len(suffix)])
                    now = time.time()
                    if (
                        script is not None
                        and script.subdomain_enabled
                        and script.serves(now)
                        and now >= script.route_live_at
                    ):
                        return WorkerTarget(f"script:{script.name}", script.name, script.sha, script.upload)
                    return None
            match = re.fullmatch(rf"({_LABEL})\.([^.]+)\.dispatch\.localhost", name)
            if match:
                namespace = self.namespaces.get(match.group(2))
                script = namespace.scripts.get(match.group(1)) if namespace else None
                if script is not None and script.serves(time.time()):
                    key = f"ns:{namespace.name}:{script.name}"
                    return WorkerTarget(key, script.name, script.sha, script.upload, namespace=namespace.name)
        return None

    def script_keys(self) -> dict[str, str]:
        """Every script of the account (its own and its namespaces'), by key, with its sha."""
        with self._lock:
            keys = {f"script:{s.name}": s.sha for s in self.scripts.values()}
            for namespace in self.namespaces.values():
                for script in namespace.scripts.values():
                    keys[f"ns:{namespace.name}:{script.name}"] = script.sha
            return keys

    def record_dispatch(self, *, namespace: str, script: str, limits: Any, status: int) -> None:
        """Log one call made through a dispatch namespace binding, with the limits it asked for."""
        with self._lock:
            self._dispatches.append(
                {"namespace": namespace, "script": script, "limits": limits, "status": status, "time": time.time()}
            )

    def dispatch_log(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._dispatches)

    def kv_binding(
        self,
        method: str,
        namespace_id: str,
        path: str,
        query: dict[str, list[str]],
        headers: dict[str, str],
        body: bytes,
    ) -> ApiResponse:
        """Serve a KV binding's request from a bound script's workerd (workerd's KV protocol:
        `GET|PUT|DELETE /{key}`, `GET /?prefix=&limit=&cursor=` to list).

        These are Workers runtime reads and writes, not API calls: they are not logged and
        draw nothing from the API rate limit.
        """
        key = unquote(path.lstrip("/"))
        with self._lock:
            namespace = self.kv_namespaces.get(namespace_id)
            if namespace is None:
                return ApiResponse(404, b"KV namespace not found", content_type="text/plain")
            if not key and method == "GET":
                prefix = (query.get("prefix") or [""])[0]
                limit = min(1000, max(1, int((query.get("limit") or ["1000"])[0] or 1000)))
                offset = int((query.get("cursor") or ["0"])[0] or 0)
                now = time.time()
                names = sorted(
                    k
                    for k, v in namespace.values.items()
                    if k.startswith(prefix) and (v.expiration is None or v.expiration > now)
                )
                page = names[offset : offset + limit]
                items = []
                for item_name in page:
                    value = namespace.values[item_name]
                    entry: dict[str, Any] = {"name": item_name}
                    if value.expiration is not None:
                        entry["expiration"] = value.expiration
                    if value.metadata is not None:
                        entry["metadata"] = value.metadata
                    items.append(entry)
                cursor = str(offset + limit) if offset + limit < len(names) else ""
                return ApiResponse(200, kv_list_body(items, cursor=cursor))
            if method == "GET":
                now = time.time()
                if self._kv_misses.get((namespace_id, key), 0.0) > now:
                    return ApiResponse(404, b"", content_type="text/plain")
                try:
                    seen = self._kv_value(namespace, key).as_seen(now)
                except ApiError:
                    seen = None
                if seen is None:
                    if self._config.kv_miss_cache_seconds:
                        self._kv_misses[(namespace_id, key)] = now + self._config.kv_miss_cache_seconds
                    return ApiResponse(404, b"", content_type="text/plain")
                value = seen
                extra = [("CF-KV-Metadata", json.dumps(value.metadata))] if value.metadata is not None else []
                return ApiResponse(200, value.value, extra, content_type="application/octet-stream")
            if method in ("PUT", "DELETE"):
                self._kv_misses.pop((namespace_id, key), None)
            if method == "PUT":
                metadata_header = headers.get("cf-kv-metadata")
                expiration = None
                if query.get("expiration_ttl"):
                    expiration = int(time.time()) + int(query["expiration_ttl"][0])
                elif query.get("expiration"):
                    expiration = int(query["expiration"][0])
                namespace.values[key] = KvValue(
                    value=body, expiration=expiration, metadata=json.loads(metadata_header) if metadata_header else None
                )
                self._save_locked()
                return ApiResponse(200, b"", content_type="text/plain")
            if method == "DELETE":
                namespace.values.pop(key, None)
                self._save_locked()
                return ApiResponse(200, b"", content_type="text/plain")
        return ApiResponse(405, b"", content_type="text/plain")

    # --- the API ------------------------------------------------------------------------------

    def handle(self, request: ApiRequest) -> ApiResponse:
        """Answer one API call as Cloudflare would, and log it."""
        config = self._config
        if config.latency:
            time.sleep(config.latency)
        now = time.monotonic()
        with self._lock:
            retry_after = self._limiter.admit(now)
            rate_headers = self._limiter.headers(now)
            fault = self._fault_status() if retry_after is None else None
        if retry_after is not None:
            seconds = max(1, math.ceil(retry_after))
            response = _error_response(
                ApiError(
                    429,
                    971,
                    f"More than {self._limiter.limit} requests per {self._limiter.window:g} seconds reached. "
                    "Please wait and consider throttling your request speed",
                ),
                [("Retry-After", str(seconds))],
            )
        elif fault is not None:
            response = _fault_response(fault)
        else:
            try:
                response = self._dispatch(request)
            except ApiError as error:
                response = _error_response(error)
            else:
                if request.method == "DELETE" and response.status == 200 and config.empty_delete_answers:
                    response = replace(response, body=b"", content_type="")
        response.headers.extend(rate_headers)
        self._record(request, response)
        return response

    def _fault_status(self) -> int | None:
        if self._config.fail_next > 0:
            self._config = replace(self._config, fail_next=self._config.fail_next - 1)
        elif not (self._config.fault_rate and self._faults.random() < self._config.fault_rate):
            return None
        # Cycle through the 5xx a client meets: an API error, an edge proxy page, an overload.
        status = (500, 502, 503)[self._fault_count % 3]
        self._fault_count += 1
        return status

    def _record(self, request: ApiRequest, response: ApiResponse) -> None:
        code = None
        if response.status >= 400 and response.content_type == "application/json":
            try:
                code = json.loads(response.body)["errors"][0]["code"]
            except (ValueError, KeyError, IndexError, TypeError):
                code = None
        entry = {
            "method": request.method,
            "path": request.path,
            "status": response.status,
            "code": code,
            "time": time.time(),
        }
        with self._lock:
            self._log.append(entry)

    def _dispatch(self, request: ApiRequest) -> ApiResponse:
        path = request.path[len(API_PREFIX) :] if request.path.startswith(API_PREFIX + "/") else None
        if path is None:
            raise ApiError(404, 7003)
        for method, pattern, handler in self._routes:  # noqa: B007  (handler is used after the break)
            match = pattern.fullmatch(path)
            if match and method == request.method:
                break
        else:
            raise ApiError(404, 7003)
        if not self._authorized(request.headers.get("authorization", "")):
            if handler == self._token_verify:
                raise ApiError(401, 1000, "Invalid API Token")
            raise ApiError(403, 10000)
        params = {key: unquote(value) for key, value in match.groupdict().items()}
        if params.pop("account", self.account_id) != self.account_id:
            raise ApiError(400, 7003, f"Could not route to {request.path}, perhaps your object identifier is invalid?")
        if "/workers/dispatch/" in path and not self._config.workers_for_platforms:
            # No public source gives Cloudflare's answer here; 403 with 10015 ("not entitled")
            # is the closest documented code, and the client reads both (docs/cloudflare.md, plans).
            raise ApiError(403, 10015, "This account is not entitled to Workers for Platforms (dispatch namespaces).")
        if request.method == "PUT" and "script" in params and not path.endswith("/tags"):
            # Parsing (and compressing) a large upload must not hold the account lock.
            params["upload"] = parse_upload(
                request.headers.get("content-type", ""),
                request.body,
                max_compressed_bytes=self._config.script_max_bytes,
            )
        with self._lock:
            response = handler(request, params)
            if request.method != "GET":
                self._save_locked()
            return response

    def _check_start(self, name: str, upload: ScriptUpload) -> None:
        """Refuse code that does not start, as Cloudflare does at upload, after the cheaper
        checks. Scripts that run in a workerd of their own (cfemulator.bound) are started
        there on first use instead."""
        if self._start_check is None or needs_own_workerd(upload):
            return
        sha = self._write_bundle(upload)
        problem = self._start_check(f"{name}@{sha}")
        if problem is not None:
            self._release(sha)
            raise ApiError(400, 10021, problem)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        # Constant-time comparison: the emulator stands in for a service that guards a secret.
        return scheme.lower() == "bearer" and bool(given) and _same(given, self._token.encode())

    def _route_table(self) -> list[tuple[str, re.Pattern[str], Handler]]:
        account = r"/accounts/(?P<account>[^/]+)"
        scripts = account + r"/workers/scripts"
        script = scripts + r"/(?P<script>[^/]+)"
        namespaces = account + r"/workers/dispatch/namespaces"
        namespace = namespaces + r"/(?P<namespace>[^/]+)"
        ns_script = namespace + r"/scripts/(?P<script>[^/]+)"
        kv = account + r"/storage/kv/namespaces"
        kv_ns = kv + r"/(?P<kv>[^/]+)"
        table: list[tuple[str, str, Handler]] = [
            # A user's token, then an account's own token (Cloudflare has both kinds).
            ("GET", r"/user/tokens/verify", self._token_verify),
            ("GET", account + r"/tokens/verify", self._token_verify),
            ("GET", scripts, self._script_list),
            ("PUT", script, self._script_upload),
            ("DELETE", script, self._script_delete),
            ("GET", script + "/settings", self._script_settings),
            ("GET", script + "/subdomain", self._script_subdomain_get),
            ("POST", script + "/subdomain", self._script_subdomain_set),
            ("DELETE", script + "/subdomain", self._script_subdomain_delete),
            ("GET", account + "/workers/subdomain", self._subdomain_get),
            ("PUT", account + "/workers/subdomain", self._subdomain_put),
            ("GET", namespaces, self._namespace_list),
            ("POST", namespaces, self._namespace_create),
            ("GET", namespace, self._namespace_get),
            ("DELETE", namespace, self._namespace_delete),
            ("GET", namespace + "/scripts", self._ns_script_list),
            ("DELETE", namespace + "/scripts", self._ns_script_bulk_delete),
            ("PUT", ns_script, self._ns_script_upload),
            ("GET", ns_script, self._ns_script_get),
            ("DELETE", ns_script, self._ns_script_delete),
            ("GET", ns_script + "/tags", self._ns_script_tags_get),
            ("PUT", ns_script + "/tags", self._ns_script_tags_put),
            ("GET", kv, self._kv_namespace_list),
            ("POST", kv, self._kv_namespace_create),
            ("GET", kv_ns, self._kv_namespace_get),
            ("DELETE", kv_ns, self._kv_namespace_delete),
            ("PUT", kv_ns + r"/values/(?P<key>[^/]+)", self._kv_put),
            ("GET", kv_ns + r"/values/(?P<key>[^/]+)", self._kv_get),
            ("DELETE", kv_ns + r"/values/(?P<key>[^/]+)", self._kv_delete),
            ("GET", kv_ns + r"/metadata/(?P<key>[^/]+)", self._kv_metadata),
            ("GET", kv_ns + "/keys", self._kv_keys),
        ]
        return [(method, re.compile(pattern), handler) for method, pattern, handler in table]

    # --- API tokens ---------------------------------------------------------------------------

    def _token_verify(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        # Cloudflare's answer for an active token; a bad one is 401/1000 (see _dispatch).
        token_id = hashlib.sha256(self._token.encode()).hexdigest()[:32]
        return _ok({"id": token_id, "status": "active"})

    # --- the code store -----------------------------------------------------------------------

    def _store(self, name: str, upload: ScriptUpload, existing: Script | None, *, propagates: bool = True) -> Script:
        """Write the bundle the loader host reads and return the script that serves it; a
        new script is served once propagated, unless not `propagates` (served at once).

        The bundle's sha covers everything the script runs with (modules, date, text
        bindings), so a change of any of them gives a new loader id and a fresh isolate.
        """
        sha = self._write_bundle(upload)
        stamp = _now()
        deployment = str(uuid.uuid4())
        if existing is None:
            live_at = time.time() + (self._config.propagation_delay if propagates else 0.0)
            return Script(
                name=name,
                sha=sha,
                upload=upload,
                created_on=stamp,
                modified_on=stamp,
                live_at=live_at,
                deployment_id=deployment,
            )
        old_sha = existing.sha
        existing.sha, existing.upload, existing.modified_on = sha, upload, stamp
        existing.deployment_id = deployment
        if old_sha != sha:
            self._release(old_sha)
        return existing

    @staticmethod
    def _kept_bindings(upload: ScriptUpload, existing: Script | None) -> ScriptUpload:
        """`upload` with the previous upload's bindings of the types its `keep_bindings` names
        carried over, unless it binds that name itself (reference §1.2: Wrangler keeps
        `secret_text` and `secret_key` this way, so secrets set apart survive a deploy)."""
        if existing is None or not upload.keep_bindings:
            return upload
        named = {binding["name"] for binding in upload.bindings}
        kept = [
            binding
            for binding in existing.upload.bindings
            if binding["type"] in upload.keep_bindings and binding["name"] not in named
        ]
        if not kept:
            return upload
        kept_names = {binding["name"] for binding in kept}
        texts = tuple(b for b in existing.upload.text_bindings if b.name in kept_names)
        return replace(upload, bindings=[*upload.bindings, *kept], text_bindings=(*upload.text_bindings, *texts))

    def _write_bundle(self, upload: ScriptUpload) -> str:
        """Write the loader host's bundle for `upload`, once per sha; return the sha."""
        bindings = tuple(
            replace(b, fingerprint=secret_fingerprint(b.value, key=self._seal_key)) if b.kind == SECRET_KIND else b
            for b in upload.text_bindings
        )
        bundle = CodeBundle(
            main_module=upload.main_module,
            modules=upload.loader_modules,
            compatibility_date=upload.compatibility_date,
            bindings=bindings,
        )
        path = self.code_dir / f"{bundle.sha}.json"
        if not path.exists():
            write_atomically(path, bundle.to_json(seal_key=self._seal_key))
        return bundle.sha

    def _release(self, sha: str) -> None:
        """Delete a bundle no script uses any more."""
        in_use = any(s.sha == sha for s in self.scripts.values()) or any(
            s.sha == sha for ns in self.namespaces.values() for s in ns.scripts.values()
        )
        if not in_use:
            (self.code_dir / f"{sha}.json").unlink(missing_ok=True)
