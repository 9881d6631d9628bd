"""The emulated account's Workers KV: namespaces, values, metadata and key listings, over the
API and through a script's KV binding (one store, two doors: the binding's reads and writes
are the Workers runtime's, not API calls)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any
from urllib.parse import unquote

from cfemulator.api_common import (
    _KV_MIN_TTL_SECONDS,
    ApiRequest,
    ApiResponse,
    _check_key,
    _int_arg,
    _int_value,
    _kv_namespace_json,
    _ok,
    _paged,
    _visible_alone,
)
from cfemulator.bound import kv_list_body
from cfemulator.envelope import ApiError
from cfemulator.state import KvNamespace, KvValue
from cfemulator.uploads import parse_form


class KvEndpoints:
    """Workers KV for `CloudflareApi`, whose state, lock and config it uses (a mixin)."""

    def _kv_namespace_list(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        everything = list(self.kv_namespaces.values())
        page, per_page = max(1, _int_arg(request, "page", 1)), min(1000, max(5, _int_arg(request, "per_page", 20)))
        chosen = everything[(page - 1) * per_page : page * per_page]
        items = [_kv_namespace_json(ns) for ns in chosen]
        info = {"page": page, "per_page": per_page, "count": len(items), "total_count": len(everything)}
        return _ok(items, result_info=info)

    def _kv_namespace_create(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        body = request.json()
        title = body.get("title") if isinstance(body, dict) else None
        if not isinstance(title, str) or not title:
            raise ApiError(400, 10021, "title is required")
        if any(ns.title == title for ns in self.kv_namespaces.values()):
            raise ApiError(400, 10014, "a namespace with this account ID and title already exists")
        namespace = KvNamespace(id=uuid.uuid4().hex, title=title)
        self.kv_namespaces[namespace.id] = namespace
        return _ok(_kv_namespace_json(namespace))

    def _kv_namespace_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(_kv_namespace_json(self._kv_namespace(params["kv"])))

    def _kv_namespace_delete(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        del self.kv_namespaces[self._kv_namespace(params["kv"]).id]
        return _ok(None)

    def _kv_put(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        namespace = self._kv_namespace(params["kv"])
        key = _check_key(params["key"])
        expiration = _expiration(request, min_ttl=_KV_MIN_TTL_SECONDS)
        value, metadata = request.body, None
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            parts = {part.name: part for part in parse_form(request.headers["content-type"], request.body)}
            if "value" not in parts:
                raise ApiError(400, 10026, "The request body could not be parsed: no value part")
            value = parts["value"].body
            if "metadata" in parts:
                try:
                    metadata = json.loads(parts["metadata"].body)
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise ApiError(400, 10026, f"metadata is not JSON ({exc})") from exc
        now = time.time()
        previous = namespace.values.get(key)
        namespace.values[key] = KvValue(
            value=value,
            expiration=expiration,
            metadata=metadata,
            visible_at=now + self._config.propagation_delay,
            previous=_visible_alone(previous, now),
        )
        return _ok(None)

    def _kv_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        item = self._kv_value(self._kv_namespace(params["kv"]), params["key"])
        headers = [("expiration", str(item.expiration))] if item.expiration is not None else []
        # KV reads are the one answer that is raw bytes, not an envelope (reference §0).
        return ApiResponse(200, item.value, headers, content_type="application/octet-stream")

    def _kv_delete(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        self._kv_namespace(params["kv"]).values.pop(params["key"], None)
        return _ok(None)

    def _kv_metadata(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(self._kv_value(self._kv_namespace(params["kv"]), params["key"]).metadata)

    def _kv_keys(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        items, cursor = _key_listing(self._kv_namespace(params["kv"]), request, least=10)
        return _ok(items, result_info={"count": len(items), "cursor": cursor})

    def _kv_namespace(self, namespace_id: str) -> KvNamespace:
        namespace = self.kv_namespaces.get(namespace_id)
        if namespace is None:
            raise ApiError(404, 10013)
        return namespace

    @staticmethod
    def _kv_value(namespace: KvNamespace, key: str) -> KvValue:
        item = namespace.values.get(key)
        if item is None or (item.expiration is not None and item.expiration <= time.time()):
            raise ApiError(404, 10009)
        return item

    # --- a script's KV binding ---------------------------------------------------------------

    def kv_binding(self, request: ApiRequest, namespace_id: str) -> ApiResponse:
        """Serve a KV binding's request from a bound script's workerd (workerd's KV protocol:
        `GET|PUT|DELETE /{key}`, `GET /?prefix=&limit=&cursor=` to list), from the same store
        as the API: a read sees what has propagated to it, a write is seen at once.

        These are Workers runtime reads and writes, not API calls: they are not logged and
        draw nothing from the API rate limit.
        """
        key = unquote(request.path.lstrip("/"))
        with self._lock:
            namespace = self.kv_namespaces.get(namespace_id)
            if namespace is None:
                return _runtime_answer(404, b"KV namespace not found")
            try:
                return self._kv_binding_call(request, namespace, key)
            except ApiError as error:
                return _runtime_answer(error.status, error.message.encode())

    def _kv_binding_call(self, request: ApiRequest, namespace: KvNamespace, key: str) -> ApiResponse:
        method = request.method
        if method == "GET" and not key:
            # workerd sends list()'s `limit` as `key_count_limit`.
            items, cursor = _key_listing(namespace, request, least=1, limit_arg="key_count_limit")
            return ApiResponse(200, kv_list_body(items, cursor=cursor))
        if method == "GET":
            return self._kv_binding_read(namespace, key)
        if method not in ("PUT", "DELETE"):
            return _runtime_answer(405, b"")
        self._kv_misses.pop((namespace.id, key), None)
        if method == "PUT":
            metadata = request.headers.get("cf-kv-metadata")
            namespace.values[key] = KvValue(
                value=request.body,
                # The binding's put() holds expirationTtl to the same minimum as the API.
                expiration=_expiration(request, min_ttl=_KV_MIN_TTL_SECONDS),
                metadata=json.loads(metadata) if metadata else None,
            )
        else:
            namespace.values.pop(key, None)
        self._save_locked()
        return _runtime_answer(200, b"")

    def _kv_binding_read(self, namespace: KvNamespace, key: str) -> ApiResponse:
        """A binding's `get`: the value as propagated to it, or a miss, cached as Cloudflare caches
        one (EmulatorConfig.kv_miss_cache_seconds)."""
        now = time.time()
        if self._kv_misses.get((namespace.id, key), 0.0) > now:
            return _runtime_answer(404, b"")
        try:
            seen = self._kv_value(namespace, key).as_seen(now)
        except ApiError:
            seen = None
        if seen is None:
            if self._config.kv_miss_cache_seconds:
                self._kv_misses[(namespace.id, key)] = now + self._config.kv_miss_cache_seconds
            return _runtime_answer(404, b"")
        extra = [("CF-KV-Metadata", json.dumps(seen.metadata))] if seen.metadata is not None else []
        return ApiResponse(200, seen.value, extra, content_type="application/octet-stream")


def _runtime_answer(status: int, body: bytes) -> ApiResponse:
    """An answer of the Workers runtime's KV: plain text, never the API's envelope."""
    return ApiResponse(status, body, content_type="text/plain")


def _expiration(request: ApiRequest, *, min_ttl: int | None) -> int | None:
    """When a written value expires (epoch seconds), from `expiration_ttl` (at least
    `min_ttl`, when given) or `expiration`; None when it does not. Raises ApiError."""
    ttl = request.arg("expiration_ttl")
    if ttl is not None:
        seconds = _int_value(ttl, "expiration_ttl")
        if min_ttl is not None and seconds < min_ttl:
            # The minimum is documented (reference §6); the code for breaking it is not.
            raise ApiError(400, 10033, f"Invalid expiration_ttl of {seconds}. Expiration TTL must be at least 60.")
        return int(time.time()) + seconds
    expiration = request.arg("expiration")
    return None if expiration is None else _int_value(expiration, "expiration")


def _key_listing(
    namespace: KvNamespace, request: ApiRequest, *, least: int, limit_arg: str = "limit"
) -> tuple[list[dict[str, Any]], str]:
    """One page of the unexpired keys under `prefix`, in order, as many as `limit_arg` asks
    (at least `least`, at most 1000) from `cursor`; and the cursor of the next page ("" after
    the last). A key written a moment ago is listed at once, through a binding as over the API."""
    prefix = request.arg("prefix", "") or ""
    now = time.time()
    names = sorted(
        key
        for key, item in namespace.values.items()
        if key.startswith(prefix) and (item.expiration is None or item.expiration > now)
    )
    page, cursor = _paged(names, request, least=least, limit_arg=limit_arg)
    return [_key_json(name, namespace.values[name]) for name in page], cursor


def _key_json(name: str, item: KvValue) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name}
    if item.expiration is not None:
        entry["expiration"] = item.expiration
    if item.metadata is not None:
        entry["metadata"] = item.metadata
    return entry
