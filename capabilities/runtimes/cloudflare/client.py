"""The Cloudflare REST client: requests, Cloudflare's envelope, retries, and each call drawn
from the shared rate budget (budget.py), its failures raised as errors.py's types."""

from __future__ import annotations

import base64
import json
import logging
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import redis
import requests
from requests.adapters import HTTPAdapter

from capabilities.runtimes.api_work import ApiClass, current_api_class
from capabilities.runtimes.cloudflare.budget import RateBudget
from capabilities.runtimes.cloudflare.errors import (
    CloudflareAuthFailure,
    CloudflareError,
    CloudflareNotFound,
    CloudflareRateLimited,
    CloudflareRejected,
    CloudflareUnavailable,
    error_for,
)
from capabilities.runtimes.cloudflare.uploads import upload_parts
from capabilities.runtimes.errors import network_failure
from sigil import redis_keys

logger = logging.getLogger(__name__)

# Wrangler sends this header on the per-script subdomain toggle (reference §3.2).
_SCRIPT_API_DATE = ("Cloudflare-Workers-Script-Api-Date", "2025-08-01")
# The client counts every API call and every 429 answer (redis_keys.CF_CALLS, CF_RATE_LIMITED),
# read by GET /metrics, and the calls by the class of the work they were made for
# (api_work.ApiClass) and by operation (OPERATIONS), so that the owner sees what spends the
# budget. It counts them per hour too, for the cost estimate's Cloudflare budget
# (capabilities/cost.py): one counter per hour since the epoch (redis_keys.cf_calls_hour, and
# a hash of them by class, one by operation), kept a little longer than the statistics' 30 days.
API_CALLS_HOURS_KEPT = 32 * 24
# What the client's calls are counted as: each method names its operation.
OPERATIONS = (
    "upload",  # a script uploaded (the account's, or a namespace's)
    "delete",  # a script deleted
    "subdomain-toggle",  # a script's workers.dev URL turned on or off
    "account-subdomain",  # the account's workers.dev subdomain read
    "settings",  # a script's settings read
    "list",  # scripts or dispatch namespaces listed
    "namespace",  # a dispatch namespace read, created or deleted
    "kv-namespace",  # KV namespaces listed or created
    "kv-read",  # a KV value read
    "kv-write",  # a KV value written
    "kv-delete",  # a KV value deleted
    "kv-list",  # KV keys listed (a page)
    "kv-bulk-write",  # KV values written in bulk (up to 10,000 in one request)
    "kv-bulk-delete",  # KV values deleted in bulk
    "token",  # the API token verified
)

# What one bulk write or delete of Workers KV may hold (reference §6): 10,000 pairs, and
# "100 megabytes or less" in all.
KV_BULK_MAX_PAIRS = 10_000
KV_BULK_MAX_BYTES = 100_000_000


# The client's tuning, each argument from its setting (sigil_site/settings.py says why each default).
TUNING_SETTINGS = {
    "rate_limit": "SIGIL_CF_RATE_LIMIT",
    "rate_window_seconds": "SIGIL_CF_RATE_WINDOW_SECONDS",
    "max_rate_wait_seconds": "SIGIL_CF_MAX_RATE_WAIT_SECONDS",
    "housekeeping_share": "SIGIL_CF_HOUSEKEEPING_SHARE",
    "max_retries": "SIGIL_CF_MAX_RETRIES",
    "timeout_seconds": "SIGIL_CF_TIMEOUT_SECONDS",
}


# --- results ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KvPair:
    """One pair of a bulk write: `value` under `key`, expiring `expiration_ttl` seconds after
    it is written (None: never; at least 60), with `metadata` (JSON, at most 1024 bytes)."""

    key: str
    value: bytes
    expiration_ttl: int | None = None
    metadata: Mapping[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        """The pair as the bulk write's body holds it: the value as text, or base64 when it
        is not UTF-8."""
        try:
            item: dict[str, Any] = {"key": self.key, "value": self.value.decode()}
        except UnicodeDecodeError:
            item = {"key": self.key, "value": base64.b64encode(self.value).decode(), "base64": True}
        if self.expiration_ttl is not None:
            item["expiration_ttl"] = self.expiration_ttl
        if self.metadata is not None:
            item["metadata"] = dict(self.metadata)
        return item


@dataclass(frozen=True)
class ScriptInfo:
    """What Sigil reads of a Worker script; Cloudflare returns more and it is ignored."""

    id: str
    etag: str = ""
    created_on: str = ""
    modified_on: str = ""

    @classmethod
    def from_result(cls, result: Mapping[str, Any]) -> ScriptInfo:
        """Read an account script, or a namespace script, whose name Cloudflare's schema nests
        in `script.id` (a flat `id` is read too, as one third-party client expects it)."""
        nested = result.get("script")
        script = nested if isinstance(nested, Mapping) else result
        return cls(
            id=str(script.get("id") or ""),
            etag=str(script.get("etag") or ""),
            created_on=str(result.get("created_on") or script.get("created_on") or ""),
            modified_on=str(result.get("modified_on") or script.get("modified_on") or ""),
        )


# --- the client ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Retries:
    """How the client tries a call again: at most `max_retries` more times, after a backoff
    of half to all of `backoff_base_seconds` * 2^attempt (capped at `backoff_max_seconds`),
    each attempt answered within `timeout_seconds`."""

    max_retries: int
    timeout_seconds: float
    backoff_base_seconds: float
    backoff_max_seconds: float


class CloudflareClient:
    """Calls the Cloudflare REST API for one account, on behalf of every runtime.

    Thread-safe for the way Sigil uses it: one instance per process, shared by threads.
    Every call raises only CloudflareError subclasses (which are runtime error types):
    CloudflareUnavailable / CloudflareRateLimited when retrying later may help, the
    CloudflareRejected family when it will not.
    """

    def __init__(
        self,
        *,
        base_url: str,
        account_id: str,
        api_token: str,
        redis: redis.Redis,
        rate_limit: int = 1000,
        rate_window_seconds: float = 300.0,
        max_rate_wait_seconds: float = 30.0,
        housekeeping_share: float = 0.2,
        max_retries: int = 4,
        timeout_seconds: float = 60.0,
        backoff_base_seconds: float = 0.5,
        backoff_max_seconds: float = 8.0,
        pool_size: int = 32,
    ) -> None:
        if not account_id or not api_token:
            raise ValueError("the Cloudflare client needs an account id and an API token")
        self.base_url = base_url.rstrip("/")
        self.account_id = account_id
        self.retries = Retries(max_retries, timeout_seconds, backoff_base_seconds, backoff_max_seconds)
        self.redis = redis
        self.budget = RateBudget(
            redis=redis,
            keys=redis_keys.cf_budget(account_id),
            limit=rate_limit,
            window_seconds=rate_window_seconds,
            max_wait_seconds=max_rate_wait_seconds,
            housekeeping_share=housekeeping_share,
        )
        self._token = api_token
        self._session = requests.Session()
        # Retries are ours (they must draw on the budget); the adapter only pools connections.
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size, max_retries=0)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._session.headers["Authorization"] = f"Bearer {api_token}"
        self._session.headers["User-Agent"] = "sigil"

    @classmethod
    def from_settings(cls) -> CloudflareClient:
        """Build the client from Django settings and the process's Redis pool.

        Raises ImproperlyConfigured without credentials.
        """
        from django.conf import settings
        from django.core.exceptions import ImproperlyConfigured

        from sigil.redis_client import get_redis

        if not settings.CF_ACCOUNT_ID or not settings.CF_API_TOKEN:
            raise ImproperlyConfigured("CF_ACCOUNT_ID and CF_API_TOKEN (or CF_API_TOKEN_FILE) are required")
        tuning = {argument: getattr(settings, name) for argument, name in TUNING_SETTINGS.items()}
        return cls(
            base_url=settings.CF_API_BASE,
            account_id=settings.CF_ACCOUNT_ID,
            api_token=settings.CF_API_TOKEN,
            redis=get_redis(),  # the process's one pool
            **tuning,
        )

    def __repr__(self) -> str:
        return f"<CloudflareClient {self.base_url} account={self.account_id}>"

    def close(self) -> None:
        self._session.close()

    # --- the API token ---------------------------------------------------------------------

    def token_verify(self) -> dict[str, Any]:
        """The token's own record (`id`, `status`: "active", "disabled" or "expired").

        Asks as a user's token, then as an account's own token (`/accounts/{id}/tokens/verify`),
        since Cloudflare has both kinds. Raises CloudflareAuthFailure when neither knows it.
        """
        try:
            return self._request("GET", "/user/tokens/verify", op="token", on_account=False)
        except CloudflareAuthFailure:
            return self._request("GET", "/tokens/verify", op="token")

    # --- Worker scripts ------------------------------------------------------------------

    def script_upload(self, name: str, **script: Any) -> ScriptInfo:
        """Create or replace the Worker script `name`; it is deployed at once. `script` holds
        upload_parts()'s keywords (modules, main_module, compatibility_date, bindings, ...).

        Idempotent. Raises CloudflareScriptTooLarge (10027), CloudflareSlotsExhausted (10037),
        CloudflareRejected (invalid name or code), CloudflareUnavailable.
        """
        return self._put_script(f"/workers/scripts/{_segment(name)}", script)

    def _put_script(self, path: str, script: Mapping[str, Any]) -> ScriptInfo:
        result = self._request("PUT", path, op="upload", files=upload_parts(**script))
        return ScriptInfo.from_result(result or {})

    def script_delete(self, name: str) -> None:
        """Delete the script `name`, with its bindings' associations (`force=true`).

        Raises CloudflareNotFound when there is no such script (callers that remove
        idempotently treat that as done), CloudflareUnavailable.
        """
        self._request("DELETE", f"/workers/scripts/{_segment(name)}", op="delete", params={"force": "true"})

    def script_list(self) -> list[ScriptInfo]:
        """Every Worker script of the account (one page; the API does not paginate it)."""
        return [ScriptInfo.from_result(item) for item in self._request("GET", "/workers/scripts", op="list") or []]

    def script_settings_get(self, name: str) -> dict[str, Any]:
        """The script's settings: bindings (secret values omitted), tags, limits, dates."""
        return self._request("GET", f"/workers/scripts/{_segment(name)}/settings", op="settings")

    def script_subdomain_set(
        self, name: str, *, enabled: bool = True, previews_enabled: bool = False
    ) -> dict[str, Any]:
        """Turn the script's workers.dev URL on or off. Idempotent.

        Right after a first upload Cloudflare may briefly answer 10007 while the script
        propagates (reference §3.2), so not-found is retried twice before it is raised.
        """
        return self._request(
            "POST",
            f"/workers/scripts/{_segment(name)}/subdomain",
            op="subdomain-toggle",
            json_body={"enabled": enabled, "previews_enabled": previews_enabled},
            headers=dict([_SCRIPT_API_DATE]),
            not_found_retries=2,
        )

    def subdomain_get(self) -> str:
        """The account's workers.dev subdomain (`<script>.<this>.workers.dev`).

        Raises CloudflareNotFound when the account has never registered one.
        """
        return str(self._request("GET", "/workers/subdomain", op="account-subdomain")["subdomain"])

    # --- Workers for Platforms: dispatch namespaces ---------------------------------------

    def namespace_create(self, name: str) -> dict[str, Any]:
        """Create the dispatch namespace `name`; returns Cloudflare's namespace object."""
        return self._request("POST", "/workers/dispatch/namespaces", op="namespace", json_body={"name": name})

    def namespace_get(self, name: str) -> dict[str, Any]:
        """The namespace object (`namespace_id`, `namespace_name`, `script_count`, ...)."""
        return self._request("GET", f"/workers/dispatch/namespaces/{_segment(name)}", op="namespace")

    def namespace_list(self) -> list[dict[str, Any]]:
        return list(self._request("GET", "/workers/dispatch/namespaces", op="list") or [])

    def namespace_delete(self, name: str) -> None:
        """Delete the namespace and every script in it. Raises CloudflareNotFound if absent."""
        self._request("DELETE", f"/workers/dispatch/namespaces/{_segment(name)}", op="namespace")

    def namespace_script_upload(self, namespace: str, name: str, **script: Any) -> ScriptInfo:
        """Create or replace a user Worker in a dispatch namespace (as script_upload)."""
        return self._put_script(f"/workers/dispatch/namespaces/{_segment(namespace)}/scripts/{_segment(name)}", script)

    def namespace_script_delete(self, namespace: str, name: str) -> None:
        """Delete one user Worker. Raises CloudflareNotFound when it is not there."""
        self._request(
            "DELETE",
            f"/workers/dispatch/namespaces/{_segment(namespace)}/scripts/{_segment(name)}",
            op="delete",
            params={"force": "true"},
        )

    def namespace_script_list(self, namespace: str, *, tags: Sequence[str] = ()) -> list[ScriptInfo]:
        """The namespace's scripts, optionally filtered by tags (`"customer-1:yes"`, `"x:no"`).

        Follows the cursor until the list is complete.
        """
        path = f"/workers/dispatch/namespaces/{_segment(namespace)}/scripts"
        params: dict[str, str] = {"limit": "1000"}
        if tags:
            params["tags"] = ",".join(tags)
        scripts: list[ScriptInfo] = []
        while True:
            envelope = self._request("GET", path, op="list", params=params, whole_envelope=True)
            scripts.extend(ScriptInfo.from_result(item) for item in envelope.get("result") or [])
            cursor = (envelope.get("result_info") or {}).get("cursor")
            if not cursor:
                return scripts
            params["cursor"] = str(cursor)

    # --- Workers KV -----------------------------------------------------------------------

    def kv_namespace_create(self, title: str) -> dict[str, Any]:
        """Create a KV namespace; returns `{id, title, ...}`. A taken title is CloudflareRejected."""
        return self._request("POST", "/storage/kv/namespaces", op="kv-namespace", json_body={"title": title})

    def kv_namespace_list(self) -> list[dict[str, Any]]:
        """Every KV namespace of the account, all pages."""
        namespaces: list[dict[str, Any]] = []
        page = 1
        while True:
            envelope = self._request(
                "GET",
                "/storage/kv/namespaces",
                op="kv-namespace",
                params={"page": str(page), "per_page": "100"},
                whole_envelope=True,
            )
            batch = envelope.get("result") or []
            namespaces.extend(batch)
            info = envelope.get("result_info") or {}
            if not batch or len(namespaces) >= int(info.get("total_count", len(namespaces))):
                return namespaces
            page += 1

    def kv_put(
        self,
        namespace_id: str,
        key: str,
        value: bytes,
        *,
        expiration_ttl: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Write `value` under `key` (overwriting it and its metadata). `expiration_ttl` is at
        least 60 s; `metadata` (at most 1024 bytes of JSON) is returned by `kv_keys`."""
        params = {"expiration_ttl": str(expiration_ttl)} if expiration_ttl is not None else None
        path = f"/storage/kv/namespaces/{_segment(namespace_id)}/values/{_segment(key)}"
        if metadata is None:
            self._request(
                "PUT",
                path,
                op="kv-write",
                data=value,
                params=params,
                headers={"Content-Type": "application/octet-stream"},
            )
            return
        # With metadata the body is multipart: `value` and `metadata` parts (reference §6).
        files = [("value", ("value", value, "application/octet-stream")), ("metadata", (None, json.dumps(metadata)))]
        self._request("PUT", path, op="kv-write", files=files, params=params)

    def kv_keys(self, namespace_id: str, *, prefix: str = "") -> list[dict[str, Any]]:
        """Every key under `prefix`, as `{name, expiration?, metadata?}`; follows the cursor."""
        path = f"/storage/kv/namespaces/{_segment(namespace_id)}/keys"
        params: dict[str, str] = {"prefix": prefix, "limit": "1000"}
        keys: list[dict[str, Any]] = []
        while True:
            envelope = self._request("GET", path, op="kv-list", params=params, whole_envelope=True)
            keys.extend(envelope.get("result") or [])
            cursor = (envelope.get("result_info") or {}).get("cursor")
            if not cursor:
                return keys
            params["cursor"] = str(cursor)

    def kv_get(self, namespace_id: str, key: str) -> bytes:
        """The raw value under `key`. Raises CloudflareNotFound (10009) when there is none."""
        return self._request(
            "GET", f"/storage/kv/namespaces/{_segment(namespace_id)}/values/{_segment(key)}", op="kv-read", raw=True
        )

    def kv_delete(self, namespace_id: str, key: str) -> None:
        """Delete `key`; deleting a missing key succeeds, as on Cloudflare."""
        self._request(
            "DELETE", f"/storage/kv/namespaces/{_segment(namespace_id)}/values/{_segment(key)}", op="kv-delete"
        )

    def kv_bulk_put(self, namespace_id: str, pairs: Sequence[KvPair]) -> list[str]:
        """Write every pair, overwriting what each key held, in as few bulk requests as
        Cloudflare takes (at most 10,000 pairs and 100 MB each). Returns the keys Cloudflare
        says it did not write (`unsuccessful_keys`), which should be written again.

        Idempotent. Raises CloudflareNotFound when the namespace is missing, CloudflareRejected
        (a key, value or metadata over its limit), CloudflareUnavailable; the requests before
        the one that failed have been written.
        """
        path = f"/storage/kv/namespaces/{_segment(namespace_id)}/bulk"
        unwritten: list[str] = []
        for batch in _bulk_batches([pair.as_json() for pair in pairs]):
            unwritten += self._bulk_unsuccessful(self._request("PUT", path, op="kv-bulk-write", json_body=batch))
        return unwritten

    def kv_bulk_delete(self, namespace_id: str, keys: Sequence[str]) -> list[str]:
        """Delete every key (a missing one too), in requests of at most 10,000 keys. Returns the
        keys Cloudflare says it did not delete, which should be deleted again.

        Idempotent. Raises CloudflareNotFound when the namespace is missing, CloudflareUnavailable.
        """
        path = f"/storage/kv/namespaces/{_segment(namespace_id)}/bulk/delete"
        unwritten: list[str] = []
        for batch in _bulk_batches(list(keys)):
            unwritten += self._bulk_unsuccessful(self._request("POST", path, op="kv-bulk-delete", json_body=batch))
        return unwritten

    @staticmethod
    def _bulk_unsuccessful(result: Any) -> list[str]:
        # Cloudflare's schema: `{successful_key_count, unsuccessful_keys}`; an answer without
        # a result (older ones had none) wrote everything.
        keys = result.get("unsuccessful_keys") if isinstance(result, dict) else None
        return [str(key) for key in keys] if isinstance(keys, list) else []

    # --- the request loop -------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        op: str,
        params: Mapping[str, str] | None = None,
        json_body: Any = None,
        data: bytes | None = None,
        files: list[tuple[str, tuple]] | None = None,
        headers: Mapping[str, str] | None = None,
        raw: bool = False,
        whole_envelope: bool = False,
        not_found_retries: int = 0,
        on_account: bool = True,
    ) -> Any:
        """Send one API call, retrying what is transient; return the envelope's `result`.

        `op` names the operation (OPERATIONS) the request is counted under, beside the class
        of the work it is made for (api_work). `path` is under the account, or under the API's
        root when `on_account` is false.
        `raw` returns the body bytes of a successful answer (KV reads are not enveloped);
        `whole_envelope` returns the parsed envelope (for `result_info`).
        """
        url = f"{self.base_url}/accounts/{_segment(self.account_id)}{path}" if on_account else self.base_url + path
        api_class = current_api_class()
        attempt = 0
        while True:
            ticket = self.budget.acquire(api_class)
            try:
                response = self._session.request(
                    method,
                    url,
                    params=params,
                    json=json_body,
                    data=data,
                    files=files,
                    headers=headers,
                    timeout=(min(10.0, self.retries.timeout_seconds), self.retries.timeout_seconds),
                )
            except (requests.ConnectionError, requests.Timeout) as exc:
                self.budget.settle(ticket)
                self._count(None, api_class=api_class, op=op)
                error: CloudflareError = CloudflareUnavailable(
                    self._redact(f"{method} {path}: {type(exc).__name__}: {network_failure(exc)}")
                )
                retry = True
            else:
                self.budget.settle(ticket)
                self._count(response.status_code, api_class=api_class, op=op)
                self._observe_rate_limit(response)
                if response.ok:
                    return self._success(response, method=method, raw=raw, whole_envelope=whole_envelope)
                error = self._error(method, path, response)
                retry = self._should_retry(response, error)
                if isinstance(error, CloudflareNotFound) and attempt < not_found_retries:
                    retry = True
            if not retry or attempt >= self.retries.max_retries:
                raise error
            delay = self._backoff(attempt)
            if isinstance(error, CloudflareRateLimited) and error.retry_after is not None:
                # Cloudflare locks the whole token out: every process waits, not only this one,
                # even when this call gives up rather than wait that long itself.
                self.budget.pause(error.retry_after)
                if error.retry_after > self.budget.allowed_wait(api_class):
                    raise error
                delay = 0.0
            attempt += 1
            logger.warning(
                "Cloudflare %s %s failed (%s); attempt %d of %d in %.2f s",
                method,
                path,
                error,
                attempt + 1,
                self.retries.max_retries + 1,
                delay,
            )
            if delay:
                time.sleep(delay)

    def _count(self, status: int | None, *, api_class: ApiClass, op: str) -> None:
        """Count the call (and a 429) for /metrics, and in its hour for the cost estimate,
        across every process: in all, by the class of the work it was made for, and by
        operation."""
        hour = int(time.time() // 3600)
        kept = API_CALLS_HOURS_KEPT * 3600
        pipe = self.redis.pipeline(transaction=False)
        pipe.incr(redis_keys.CF_CALLS)
        pipe.hincrby(redis_keys.CF_CALLS_BY_CLASS, api_class.value, 1)
        pipe.hincrby(redis_keys.CF_CALLS_BY_OPERATION, op, 1)
        pipe.incr(redis_keys.cf_calls_hour(hour))
        pipe.expire(redis_keys.cf_calls_hour(hour), kept)
        pipe.hincrby(redis_keys.cf_calls_hour_by_class(hour), api_class.value, 1)
        pipe.expire(redis_keys.cf_calls_hour_by_class(hour), kept)
        pipe.hincrby(redis_keys.cf_calls_hour_by_operation(hour), op, 1)
        pipe.expire(redis_keys.cf_calls_hour_by_operation(hour), kept)
        if status == 429:
            pipe.incr(redis_keys.CF_RATE_LIMITED)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            # The call itself is done; failing it now would only make it run again.
            logger.warning("could not count a Cloudflare API call in Redis: %s", exc)

    def _observe_rate_limit(self, response: requests.Response) -> None:
        """Take Cloudflare's own count into the shared budget (reference §7.2): `Ratelimit`'s
        `r` is what the token has left of the window, whoever spent it (the owner's dashboard
        and scripts draw on it too), `t` the seconds until it resets; `Ratelimit-Policy` is the
        quota `q` per `w` seconds. Nothing left pauses every process until the reset, so the
        next call is not the one that locks the token out for the whole window."""
        remaining, reset = _rate_fields(response.headers.get("Ratelimit"), "r", "t")
        quota, window = _rate_fields(response.headers.get("Ratelimit-Policy"), "q", "w")
        if quota is not None and window is not None:
            self.budget.adopt_policy(limit=int(quota), window_seconds=window)
        if remaining is not None and remaining <= 0 and reset:
            self.budget.pause(reset)

    def _success(self, response: requests.Response, *, method: str, raw: bool, whole_envelope: bool) -> Any:
        if raw:
            return response.content
        if method == "DELETE" and not response.content.strip():
            # A delete may be answered with no body at all (2xx, or 204): it is done.
            return None
        try:
            envelope = response.json()
        except ValueError as exc:
            raise CloudflareUnavailable(
                f"Cloudflare answered {response.status_code} with a body that is not JSON", status=response.status_code
            ) from exc
        if not isinstance(envelope, dict) or envelope.get("success") is False:
            # A 2xx with success=false does not happen in the reference; treat it as a failure.
            raise self._error_from_envelope(response.status_code, envelope, "", "", None)
        return envelope if whole_envelope else envelope.get("result")

    def _error(self, method: str, path: str, response: requests.Response) -> CloudflareError:
        try:
            envelope = response.json()
        except ValueError:
            envelope = None
        return self._error_from_envelope(response.status_code, envelope, method, path, _retry_after(response))

    def _error_from_envelope(
        self, status: int, envelope: Any, method: str, path: str, retry_after: float | None
    ) -> CloudflareError:
        where = f"{method} {path}: " if method else ""
        return error_for(status, envelope, where=where, path=path, retry_after=retry_after, redact=self._redact)

    @staticmethod
    def _should_retry(response: requests.Response, error: CloudflareError) -> bool:
        # Cloudflare may override the decision, as its SDK honours (reference §0).
        override = response.headers.get("x-should-retry", "").lower()
        if override in ("true", "false"):
            return override == "true"
        return isinstance(error, CloudflareUnavailable)

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with jitter: half to all of base * 2^attempt, capped."""
        retries = self.retries
        ceiling = min(retries.backoff_max_seconds, retries.backoff_base_seconds * (2**attempt))
        return ceiling * random.uniform(0.5, 1.0)

    def _redact(self, text: str) -> str:
        # A server (or a proxy in between) may echo request headers into an error message.
        return text.replace(self._token, "[redacted]") if self._token else text


# --- request paths and answers ----------------------------------------------------------------


def _segment(value: str) -> str:
    """One URL path segment, percent-encoded (KV keys may hold `/`, `?` and the like).

    Raises CloudflareRejected, sending nothing, when empty: `.../scripts/` would address the
    whole collection (a name misread from a listing must never become a delete of everything).
    """
    if not value:
        raise CloudflareRejected("an empty name in a Cloudflare API path; nothing was sent")
    return quote(value, safe="")


def _bulk_batches(items: list[Any]) -> Iterator[list[Any]]:
    """`items` (a bulk request's JSON items) cut into requests within KV_BULK_MAX_PAIRS and
    KV_BULK_MAX_BYTES (of JSON)."""
    batch: list[Any] = []
    size = 2  # the array's brackets
    for item in items:
        length = len(json.dumps(item).encode()) + 1  # and its comma
        if batch and (len(batch) == KV_BULK_MAX_PAIRS or size + length > KV_BULK_MAX_BYTES):
            yield batch
            batch, size = [], 2
        batch.append(item)
        size += length
    if batch:
        yield batch


def _rate_fields(header: str | None, *names: str) -> tuple[float | None, ...]:
    """The named parameters of an RFC 9651-style rate limit header, `"default";r=50;t=30`
    (the first item of a list); None for each that is missing or not a number."""
    values: dict[str, float] = {}
    if header:
        for part in header.split(",", 1)[0].split(";")[1:]:
            key, _, raw = part.strip().partition("=")
            try:
                values[key.strip()] = float(raw)
            except ValueError:
                continue
    return tuple(values.get(name) for name in names)


def _retry_after(response: requests.Response) -> float | None:
    """Retry-After in seconds (Cloudflare sends whole seconds, only on 429)."""
    raw = response.headers.get("Retry-After")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None
