"""The emulated Cloudflare account and the REST endpoints Sigil uses, as the reference describes them.

Covered: verifying the API token, Worker scripts (upload, delete, list, settings), the
workers.dev subdomain (account and per script), Workers for Platforms dispatch namespaces and
their scripts, Workers KV namespaces and values; and the script lifecycle wrangler and the
official SDK drive (services, versions, deployments, code, secrets, script and account
settings, the user and its accounts: `api_lifecycle`), compatibility checked at upload
(`compat`). With Cloudflare's envelope, error codes, script quota, size limit and rate limit
(a 429 with code 971 locks the token out for the rest of the window), plus injected latency
and faults. Anything else answers 7003, as an unknown route does (docs/cloudflare.md lists
what is kept and what is not).

Uploaded bundles are written to `code_dir` as `{sha}.json` (the loader host's format, with
secret_text values sealed for the emulator's workerd: `cfemulator.hostcode`), so each
script's workerd runs them (`cfemulator.scripts`); `resolve_host` maps a workers.dev Host to
the script it runs. Scripts binding KV, a Worker Loader or a dispatch namespace run from a
config of their own (`cfemulator.bound`), whose KV reads and writes `kv_binding`
(`cfemulator.api_kv`) serves from this account's one KV store.

One module per concern: this one holds the account (control, routing, lock-out, logs); the
endpoints are in `api_scripts`, `api_lifecycle`, `api_namespaces` and `api_kv`, what they share in
`api_common`, an upload's way into the account in `codestore`, the settings in `config`,
the rate limit in `ratelimit`, and the account's records (scripts, namespaces, KV values)
in `state`.
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from cfemulator.api_common import (
    _LABEL,
    ApiRequest,
    ApiResponse,
    _error_response,
    _fault_response,
    _ok,
    _same,
)
from cfemulator.api_kv import KvEndpoints
from cfemulator.api_lifecycle import LifecycleEndpoints, default_account_settings
from cfemulator.api_namespaces import NamespaceEndpoints
from cfemulator.api_scripts import ScriptEndpoints
from cfemulator.bound import needs_own_workerd
from cfemulator.codestore import CodeStore
from cfemulator.compat import RuntimeCompat

# Named here too, as callers of the emulator (benchmarks) import them from here.
from cfemulator.config import DEV_ACCOUNT_ID, DEV_TOKEN, EmulatorConfig  # noqa: F401
from cfemulator.envelope import ApiError
from cfemulator.ratelimit import LockoutWindow
from cfemulator.state import AccountState, DispatchNamespace, KvNamespace, KvValue, Script, load_state, save_state
from cfemulator.uploads import ScriptUpload, parse_upload

logger = logging.getLogger(__name__)

API_PREFIX = "/client/v4"
# How many API calls the request log keeps; enough for any test, bounded for long dev runs.
_LOG_SIZE = 10_000
Handler = Callable[[ApiRequest, dict[str, str]], ApiResponse]


@dataclass(frozen=True)
class WorkerTarget:
    """The script a Worker request runs: an account script, or one in a dispatch namespace."""

    key: str  # "script:{name}" or "ns:{namespace}:{name}": one workerd process per key
    name: str
    sha: str
    upload: ScriptUpload
    namespace: str | None = None
    #: "produce" when Tail Workers receive its events (cfemulator.tails), else ""
    tails: str = ""
    #: the upload's place among the account's uploads (Script.generation)
    generation: int = 0

    @property
    def runs_bound(self) -> bool:
        """Whether it needs a workerd config of its own for its bindings or its tail (see cfemulator.bound)."""
        return needs_own_workerd(self.upload) or bool(self.tails)


class CloudflareApi(ScriptEndpoints, LifecycleEndpoints, NamespaceEndpoints, KvEndpoints, CodeStore):
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
        runtime: RuntimeCompat | None = None,
    ) -> None:
        self.account_id = account_id
        # The dates and flags the emulator's workerd runs, which uploads are checked against
        # (cfemulator.compat); without it, only the clock's date is.
        self._runtime = runtime
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
        # Uploads made so far, a reset's included: each upload's Script.generation.
        self._generation = 0
        self._state_file: Path | None = None  # not saved while the start state is set up
        self._reset_locked()
        if state_file is not None:
            self._restore(state_file)
            self._state_file = state_file
            with self._lock:
                self._save_locked()  # as this version keeps it (an older file's secrets sealed)

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
        # version id -> the code of each version uploaded in this run (a deployment picks one)
        self._version_uploads: dict[str, ScriptUpload] = {}
        # The account's Workers settings (not kept across a restart).
        self.account_settings = default_account_settings()
        self._log: deque[dict[str, Any]] = deque(maxlen=_LOG_SIZE)
        self._dispatches: deque[dict[str, Any]] = deque(maxlen=_LOG_SIZE)
        self._limiter = LockoutWindow(self._config.rate_limit, self._config.rate_window)
        self._faults = random.Random(self._config.fault_seed)
        self._fault_count = 0
        # (location, namespace id, key) -> what a location of the Workers runtime holds of a KV
        # key (None: a miss) and until when (see EmulatorConfig.kv_propagation_seconds,
        # kv_miss_cache_seconds). A cache, not state: a restart forgets it.
        self._kv_held: dict[tuple[str, str, str], tuple[KvValue | None, float]] = {}
        # (namespace id, key) -> when a binding last wrote it (monotonic): one write a second.
        self._kv_key_writes: dict[tuple[str, str], float] = {}
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
                if script.deployment_id:
                    self._version_uploads[script.deployment_id] = script.upload
                self._generation = max(self._generation, script.generation)

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
                        tails = "produce" if script.upload.tail_consumers else ""
                        return WorkerTarget(
                            f"script:{script.name}",
                            script.name,
                            script.sha,
                            script.upload,
                            tails=tails,
                            generation=script.generation,
                        )
                    return None
            match = re.fullmatch(rf"({_LABEL})\.([^.]+)\.dispatch\.localhost", name)
            if match:
                namespace = self.namespaces.get(match.group(2))
                script = namespace.scripts.get(match.group(1)) if namespace else None
                if script is not None and script.serves(time.time()):
                    key = f"ns:{namespace.name}:{script.name}"
                    tails = "produce" if self._dispatch_tail_consumers_locked(namespace.name) else ""
                    return WorkerTarget(
                        key,
                        script.name,
                        script.sha,
                        script.upload,
                        namespace=namespace.name,
                        tails=tails,
                        generation=script.generation,
                    )
        return None

    def same_zone(self, host: str) -> bool:
        """Whether `host` is on the account's own workers.dev zone (`{name}.{subdomain}.workers.dev`)."""
        name = host.split(":", 1)[0].lower().rstrip(".")
        with self._lock:
            return bool(self.subdomain) and name.endswith(f".{self.subdomain}.workers.dev")

    def tail_consumers_of(self, key: str) -> tuple[str, str | None, list[Script]]:
        """For the process `key` ("script:{name}" or "ns:{namespace}:{name}"): the producer's
        script name, its dispatch namespace, and the scripts that consume its tail events. A
        namespace script's events go to the Tail Workers of the Worker binding its namespace
        (Cloudflare's dispatch Worker). A consumer that does not exist receives nothing."""
        kind, _, rest = key.partition(":")
        with self._lock:
            if kind == "ns":
                namespace, _, name = rest.partition(":")
                wanted = self._dispatch_tail_consumers_locked(namespace)
            else:
                namespace, name = None, rest
                script = self.scripts.get(name)
                wanted = list(script.upload.tail_consumers) if script is not None else []
            consumers = []
            for consumer in wanted:
                home = self.namespaces.get(consumer["namespace"]) if consumer.get("namespace") else None
                scripts = home.scripts if home is not None else self.scripts
                found = scripts.get(consumer["service"])
                if found is not None and all(found is not kept for kept in consumers):
                    consumers.append(found)
        return name, namespace, consumers

    def _dispatch_tail_consumers_locked(self, namespace: str) -> list[dict[str, str]]:
        return [
            consumer
            for script in self.scripts.values()
            if any(
                b.get("type") == "dispatch_namespace" and b.get("namespace") == namespace
                for b in script.upload.bindings
            )
            for consumer in script.upload.tail_consumers
        ]

    def record_dispatch(self, *, namespace: str, script: str, limits: Any, status: int) -> None:
        """Log one call made through a dispatch namespace binding, with the limits it asked for."""
        with self._lock:
            self._dispatches.append(
                {"namespace": namespace, "script": script, "limits": limits, "status": status, "time": time.time()}
            )

    def dispatch_log(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._dispatches)

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
        for pattern, methods in self._routes:
            match = pattern.fullmatch(path)
            if match and request.method in methods:
                handler = methods[request.method]
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
        if _carries_upload(request.method, path) and "script" in params:
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

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        # Constant-time comparison: the emulator stands in for a service that guards a secret.
        return scheme.lower() == "bearer" and bool(given) and _same(given, self._token.encode())

    def _route_table(self) -> list[tuple[re.Pattern[str], dict[str, Handler]]]:
        """Each path the API serves, with its handler for each method (paths never overlap)."""
        account = r"/accounts/(?P<account>[^/]+)"
        scripts = account + r"/workers/scripts"
        script = scripts + r"/(?P<script>[^/]+)"
        namespaces = account + r"/workers/dispatch/namespaces"
        namespace = namespaces + r"/(?P<namespace>[^/]+)"
        ns_script = namespace + r"/scripts/(?P<script>[^/]+)"
        kv = account + r"/storage/kv/namespaces"
        kv_ns = kv + r"/(?P<kv>[^/]+)"
        value = kv_ns + r"/values/(?P<key>[^/]+)"
        table: dict[str, dict[str, Handler]] = {
            # A user's token, then an account's own token (Cloudflare has both kinds).
            r"/user/tokens/verify": {"GET": self._token_verify},
            account + r"/tokens/verify": {"GET": self._token_verify},
            scripts: {"GET": self._script_list},
            script: {"PUT": self._script_upload, "DELETE": self._script_delete},
            script + "/settings": {"GET": self._script_settings},
            script + "/subdomain": {
                "GET": self._script_subdomain_get,
                "POST": self._script_subdomain_set,
                "DELETE": self._script_subdomain_delete,
            },
            account + "/workers/subdomain": {"GET": self._subdomain_get, "PUT": self._subdomain_put},
            namespaces: {"GET": self._namespace_list, "POST": self._namespace_create},
            namespace: {"GET": self._namespace_get, "DELETE": self._namespace_delete},
            namespace + "/scripts": {"GET": self._ns_script_list, "DELETE": self._ns_script_bulk_delete},
            ns_script: {"PUT": self._ns_script_upload, "GET": self._ns_script_get, "DELETE": self._ns_script_delete},
            ns_script + "/tags": {"GET": self._ns_script_tags_get, "PUT": self._ns_script_tags_put},
            kv: {"GET": self._kv_namespace_list, "POST": self._kv_namespace_create},
            kv_ns: {"GET": self._kv_namespace_get, "DELETE": self._kv_namespace_delete},
            value: {"PUT": self._kv_put, "GET": self._kv_get, "DELETE": self._kv_delete},
            kv_ns + r"/metadata/(?P<key>[^/]+)": {"GET": self._kv_metadata},
            # DELETE is the deprecated form of POST .../bulk/delete (reference §6).
            kv_ns + "/bulk": {"PUT": self._kv_bulk_put, "DELETE": self._kv_bulk_delete},
            kv_ns + "/bulk/delete": {"POST": self._kv_bulk_delete},
            kv_ns + "/keys": {"GET": self._kv_keys},
            kv_ns + "/bulk/get": {"POST": self._kv_bulk_get},
            # A script's lifecycle as wrangler and the SDK drive it (cfemulator.api_lifecycle).
            account + r"/workers/services/(?P<script>[^/]+)": {"GET": self._service_get, "DELETE": self._script_delete},
            script + "/versions": {"GET": self._version_list, "POST": self._version_upload},
            script + r"/versions/(?P<version>[^/]+)": {"GET": self._version_get},
            script + "/deployments": {"GET": self._deployment_list, "POST": self._deployment_create},
            script + r"/deployments/(?P<deployment>[^/]+)": {"GET": self._deployment_get},
            script + "/content": {"PUT": self._content_put},
            script + "/content/v2": {"GET": self._content_get},
            script + "/script-settings": {"GET": self._script_settings_get, "PATCH": self._script_settings_patch},
            script + "/secrets": {"GET": self._secret_list, "PUT": self._secret_put},
            script + r"/secrets/(?P<secret>[^/]+)": {"GET": self._secret_get, "DELETE": self._secret_delete},
            account + "/workers/account-settings": {
                "GET": self._account_settings_get,
                "PUT": self._account_settings_put,
            },
            r"/user": {"GET": self._user_get},
            r"/accounts": {"GET": self._account_list},
            account: {"GET": self._account_get},
            r"/memberships": {"GET": self._membership_list},
        }
        return [(re.compile(pattern), methods) for pattern, methods in table.items()]

    # --- API tokens ---------------------------------------------------------------------------

    def _token_verify(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        # Cloudflare's answer for an active token; a bad one is 401/1000 (see _dispatch).
        token_id = hashlib.sha256(self._token.encode()).hexdigest()[:32]
        return _ok({"id": token_id, "status": "active"})


def _carries_upload(method: str, path: str) -> bool:
    """Whether the call's body is a script upload (multipart, parsed outside the lock):
    a script's upload or its code alone, a namespace script's, or a new version."""
    if method == "PUT":
        return not path.endswith(("/tags", "/secrets", "/script-settings", "/account-settings"))
    return method == "POST" and path.endswith("/versions")
