"""The emulated account's Workers KV: namespaces, values, metadata and key listings."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from cfemulator.api_common import (
    _KV_MIN_TTL_SECONDS,
    ApiRequest,
    ApiResponse,
    _check_key,
    _int_arg,
    _int_value,
    _kv_namespace_json,
    _ok,
    _visible_alone,
)
from cfemulator.envelope import ApiError
from cfemulator.state import KvNamespace, KvValue
from cfemulator.uploads import ScriptUpload, parse_form


class KvEndpoints:
    """The Workers KV endpoints of `CloudflareApi` (a mixin: the account's state, lock and
    config are the API's)."""

    # --- Workers KV ---------------------------------------------------------------------------

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
        expiration: int | None = None
        ttl = request.arg("expiration_ttl")
        if ttl is not None:
            seconds = _int_value(ttl, "expiration_ttl")
            if seconds < _KV_MIN_TTL_SECONDS:
                # The minimum is documented (reference §6); the code for breaking it is not.
                raise ApiError(400, 10033, f"Invalid expiration_ttl of {seconds}. Expiration TTL must be at least 60.")
            expiration = int(time.time()) + seconds
        elif request.arg("expiration") is not None:
            expiration = _int_value(request.arg("expiration") or "", "expiration")
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
        namespace = self._kv_namespace(params["kv"])
        prefix = request.arg("prefix", "") or ""
        now = time.time()
        names = sorted(
            key
            for key, item in namespace.values.items()
            if key.startswith(prefix) and (item.expiration is None or item.expiration > now)
        )
        limit = min(1000, max(10, _int_arg(request, "limit", 1000)))
        offset = _int_arg(request, "cursor", 0)
        page = names[offset : offset + limit]
        cursor = str(offset + limit) if offset + limit < len(names) else ""
        items = []
        for name in page:
            item = namespace.values[name]
            entry: dict[str, Any] = {"name": name}
            if item.expiration is not None:
                entry["expiration"] = item.expiration
            if item.metadata is not None:
                entry["metadata"] = item.metadata
            items.append(entry)
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

    def _check_binding_targets(self, upload: ScriptUpload) -> None:
        """A KV binding must name a KV namespace of the account (10042), a dispatch namespace
        binding a dispatch namespace (10021), and a Worker Loader needs the Paid plan (10021,
        with the text a free account gets)."""
        for binding in upload.bindings:
            kind = binding["type"]
            if kind == "worker_loader" and self._config.plan != "paid":
                raise ApiError(400, 10021, f"binding {binding['name']} of type {kind} is invalid")
            if kind == "kv_namespace" and binding["namespace_id"] not in self.kv_namespaces:
                raise ApiError(400, 10042, f"KV namespace '{binding['namespace_id']}' is not valid.")
            if kind == "dispatch_namespace" and binding["namespace"] not in self.namespaces:
                raise ApiError(
                    400, 10021, f"binding {binding['name']} of type {kind} is invalid: no such dispatch namespace"
                )
