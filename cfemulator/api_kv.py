"""The emulated account's Workers KV: namespaces, values, metadata and key listings, over the
API (one key at a time, or up to 10,000 in a bulk write or delete) and through a script's KV
binding (one store, two doors: the binding's reads and writes are the Workers runtime's, not
API calls).

Workers KV as its docs describe it ("How KV works", "Limits", the FAQ):

- **Eventually consistent.** Writes go to the central store, which the API reads and lists.
  Each location of the Workers runtime (here: each bound script's process) keeps what it read
  for a while: a value for `kv_propagation_seconds` (60 s, as a read's default cacheTtl), a
  miss for `kv_miss_cache_seconds`; it reads the central store again after that. So a write
  made elsewhere reaches a location that holds the key within that time, and one that holds
  nothing at once; a binding's own write (or delete) is what its location holds from then on,
  so it is seen there at once. A binding's listing reads the central store.
- **Limits.** Keys of at most 512 bytes, values of 25 MiB, metadata of 1024 bytes (as JSON);
  a bulk request of at most 10,000 pairs and 100 MB (the emulator's body limit,
  `cfemulator.bodies`). A binding writes one key at most once a second: past it, `put`
  throws "KV PUT failed: 429 Too Many Requests". The API's writes are held by the API's own
  rate limit instead (the KV FAQ, "What is KV's write rate limit?").

No public source gives the API's codes for a value, metadata or bulk request over its limit:
the emulator answers 413 (sizes) or 400 (the count of pairs) with 10021, and Sigil's client
reads the status.
"""

from __future__ import annotations

import base64
import binascii
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
)
from cfemulator.bound import KV_LOCATION_HEADER, kv_list_body
from cfemulator.envelope import ApiError
from cfemulator.state import KvNamespace, KvValue
from cfemulator.uploads import parse_form

# Workers KV's limits (KV docs, "Limits"; reference §6).
VALUE_MAX_BYTES = 25 * 1024 * 1024
METADATA_MAX_BYTES = 1024
BULK_MAX_PAIRS = 10_000
# A bulk read takes at most 100 keys (Workers KV limits).
BULK_GET_MAX_KEYS = 100
# A binding's writes of one key: at most one a second.
KEY_WRITE_INTERVAL_SECONDS = 1.0


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
        expiration = _expiration(request.arg("expiration_ttl"), request.arg("expiration"), min_ttl=_KV_MIN_TTL_SECONDS)
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
        _check_sizes(value, metadata)
        namespace.values[key] = KvValue(value=value, expiration=expiration, metadata=metadata)
        return _ok(None)

    def _kv_bulk_put(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        """Write up to 10,000 pairs (`[{key, value, expiration?, expiration_ttl?, metadata?,
        base64?}]`): all of them, or none when one breaks a rule."""
        namespace = self._kv_namespace(params["kv"])
        pairs = _bulk_items(request)
        writes = []
        for pair in pairs:
            if not (isinstance(pair, dict) and isinstance(pair.get("key"), str) and isinstance(pair.get("value"), str)):
                raise ApiError(400, 10026, "each pair is an object with a string key and a string value")
            key = _check_key(pair["key"])
            value = pair["value"].encode()
            if pair.get("base64") is True:
                try:
                    value = base64.b64decode(value, validate=True)
                except binascii.Error as exc:
                    raise ApiError(400, 10026, f"the value of {key!r} is not base64 ({exc})") from exc
            ttl, at = pair.get("expiration_ttl"), pair.get("expiration")
            expiration = _expiration(
                None if ttl is None else str(ttl), None if at is None else str(at), min_ttl=_KV_MIN_TTL_SECONDS
            )
            metadata = pair.get("metadata")
            _check_sizes(value, metadata)
            writes.append((key, KvValue(value=value, expiration=expiration, metadata=metadata)))
        namespace.values.update(writes)
        return _ok({"successful_key_count": len(writes), "unsuccessful_keys": []})

    def _kv_bulk_delete(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        """Delete up to 10,000 keys (`["key", ...]`); a key that is not there is deleted too."""
        namespace = self._kv_namespace(params["kv"])
        keys = _bulk_items(request)
        if not all(isinstance(key, str) for key in keys):
            raise ApiError(400, 10026, "the body is an array of key names")
        for key in keys:
            _check_key(key)
        for key in keys:
            namespace.values.pop(key, None)
        return _ok({"successful_key_count": len(keys), "unsuccessful_keys": []})

    def _kv_bulk_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        """Read up to 100 keys (`{"keys": [...], "type": "text"|"json", "withMetadata": bool}`):
        each key's value (parsed when `type` is json), or null when it is not there."""
        namespace = self._kv_namespace(params["kv"])
        body = request.json()
        keys = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(keys, list) or not keys or not all(isinstance(key, str) for key in keys):
            raise ApiError(400, 10026, 'The request body could not be parsed: it is {"keys": ["key", ...]}')
        if len(keys) > BULK_GET_MAX_KEYS:
            raise ApiError(400, 10021, f"a bulk get reads at most {BULK_GET_MAX_KEYS} keys, not {len(keys)}")
        kind = body.get("type", "text")
        if kind not in ("text", "json"):
            raise ApiError(400, 10021, 'type is "text" or "json"')
        now = time.time()
        values: dict[str, Any] = {}
        for key in keys:
            item = namespace.values.get(_check_key(key))
            if item is None or not item.live(now):
                values[key] = None
                continue
            value = _bulk_value(item.value, kind, key)
            if body.get("withMetadata"):
                value = {"value": value, "metadata": item.metadata, "expiration": item.expiration}
            values[key] = value
        return _ok({"values": values})

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
        """The key's value in the central store (what the API reads). Raises ApiError 10009."""
        item = namespace.values.get(key)
        if item is None or not item.live(time.time()):
            raise ApiError(404, 10009)
        return item

    # --- a script's KV binding ---------------------------------------------------------------

    def kv_binding(self, request: ApiRequest, namespace_id: str) -> ApiResponse:
        """Serve a KV binding's request from a bound script's workerd (workerd's KV protocol:
        `GET|PUT|DELETE /{key}`, `GET /?prefix=&limit=&cursor=` to list), from the same store
        as the API, at the script's location (KV_LOCATION_HEADER): a read answers what the
        location holds while it holds it, else the central store's value; a write is held there
        at once.

        These are Workers runtime reads and writes, not API calls: they are not logged and
        draw nothing from the API rate limit.
        """
        key = unquote(request.path.lstrip("/"))
        location = request.headers.get(KV_LOCATION_HEADER, "")
        with self._lock:
            namespace = self.kv_namespaces.get(namespace_id)
            if namespace is None:
                return _runtime_answer(404, b"KV namespace not found")
            try:
                return self._kv_binding_call(request, namespace, key, location)
            except ApiError as error:
                return _runtime_answer(error.status, error.message.encode())

    def _kv_binding_call(self, request: ApiRequest, namespace: KvNamespace, key: str, location: str) -> ApiResponse:
        method = request.method
        if method == "GET" and not key:
            # workerd sends list()'s `limit` as `key_count_limit`.
            items, cursor = _key_listing(namespace, request, least=1, limit_arg="key_count_limit")
            return ApiResponse(200, kv_list_body(items, cursor=cursor))
        if method == "GET":
            return self._kv_binding_read(namespace, key, location)
        if method not in ("PUT", "DELETE"):
            return _runtime_answer(405, b"")
        written = None
        if method == "PUT":
            raw_metadata = request.headers.get("cf-kv-metadata")
            metadata = json.loads(raw_metadata) if raw_metadata else None
            _check_sizes(request.body, metadata)
            now = time.monotonic()
            last = self._kv_key_writes.get((namespace.id, key))
            if last is not None and now - last < KEY_WRITE_INTERVAL_SECONDS:
                # workerd then throws "KV PUT failed: 429 Too Many Requests" from `put` (KV
                # docs, "Limits to KV writes to the same key").
                return _runtime_answer(429, b"")
            self._kv_key_writes[(namespace.id, key)] = now
            # The binding's put() holds expirationTtl to the same minimum as the API.
            ttl, at = request.arg("expiration_ttl"), request.arg("expiration")
            expiration = _expiration(ttl, at, min_ttl=_KV_MIN_TTL_SECONDS)
            written = namespace.values[key] = KvValue(value=request.body, expiration=expiration, metadata=metadata)
        else:
            namespace.values.pop(key, None)
        self._kv_hold(location, namespace, key, written)  # seen where it was made at once
        self._save_locked()
        return _runtime_answer(200, b"")

    def _kv_binding_read(self, namespace: KvNamespace, key: str, location: str) -> ApiResponse:
        """A binding's `get` at `location`: what the location holds, while it holds it, else
        the central store's value, which the location then holds (a miss too, as Cloudflare
        caches one: EmulatorConfig.kv_miss_cache_seconds)."""
        now = time.time()
        held = self._kv_held.get((location, namespace.id, key))
        if held is not None and held[1] > now:
            seen = held[0]
        else:
            seen = namespace.values.get(key)
            self._kv_hold(location, namespace, key, seen)
        if seen is None or not seen.live(now):
            return _runtime_answer(404, b"")
        extra = [("CF-KV-Metadata", json.dumps(seen.metadata))] if seen.metadata is not None else []
        return ApiResponse(200, seen.value, extra, content_type="application/octet-stream")

    def _kv_hold(self, location: str, namespace: KvNamespace, key: str, seen: KvValue | None) -> None:
        """Have `location` hold `seen` (None: a miss) as the key's value, for as long as the
        config says a location holds a value, or a miss."""
        config = self._config
        seconds = config.kv_miss_cache_seconds if seen is None else config.kv_propagation_seconds
        if seconds:
            self._kv_held[(location, namespace.id, key)] = (seen, time.time() + seconds)
        else:
            self._kv_held.pop((location, namespace.id, key), None)


def _runtime_answer(status: int, body: bytes) -> ApiResponse:
    """An answer of the Workers runtime's KV: plain text, never the API's envelope."""
    return ApiResponse(status, body, content_type="text/plain")


def _expiration(ttl: str | None, expiration: str | None, *, min_ttl: int | None) -> int | None:
    """When a written value expires (epoch seconds), from `expiration_ttl` (at least `min_ttl`,
    when given), which wins, or `expiration`; None when it does not. Raises ApiError."""
    if ttl is not None:
        seconds = _int_value(ttl, "expiration_ttl")
        if min_ttl is not None and seconds < min_ttl:
            # The minimum is documented (reference §6); the code for breaking it is not.
            raise ApiError(400, 10033, f"Invalid expiration_ttl of {seconds}. Expiration TTL must be at least 60.")
        return int(time.time()) + seconds
    return None if expiration is None else _int_value(expiration, "expiration")


def _check_sizes(value: bytes, metadata: Any) -> None:
    """Raises ApiError (413) for a value over 25 MiB or metadata over 1024 bytes of JSON."""
    if len(value) > VALUE_MAX_BYTES:
        raise ApiError(413, 10021, f"Value length of {len(value)} exceeds limit of {VALUE_MAX_BYTES}.")
    if metadata is not None:
        length = len(json.dumps(metadata, separators=(",", ":")).encode())
        if length > METADATA_MAX_BYTES:
            raise ApiError(413, 10021, f"Metadata length of {length} exceeds limit of {METADATA_MAX_BYTES}.")


def _bulk_value(raw: bytes, kind: str, key: str) -> Any:
    try:
        text = raw.decode()
        return json.loads(text) if kind == "json" else text
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, 10021, f"the value of {key!r} is not {kind} ({exc})") from None


def _bulk_items(request: ApiRequest) -> list[Any]:
    """The JSON array of a bulk request, of at most BULK_MAX_PAIRS items. Raises ApiError."""
    items = request.json()
    if not isinstance(items, list):
        raise ApiError(400, 10026, "The request body could not be parsed: a bulk request is a JSON array")
    if len(items) > BULK_MAX_PAIRS:
        raise ApiError(400, 10021, f"a bulk request holds at most {BULK_MAX_PAIRS} keys, not {len(items)}")
    return items


def _key_listing(
    namespace: KvNamespace, request: ApiRequest, *, least: int, limit_arg: str = "limit"
) -> tuple[list[dict[str, Any]], str]:
    """One page of the unexpired keys under `prefix`, in order, as many as `limit_arg` asks
    (at least `least`, at most 1000) from `cursor`; and the cursor of the next page ("" after
    the last). A key written a moment ago is listed at once, through a binding as over the API."""
    prefix = request.arg("prefix", "") or ""
    now = time.time()
    names = sorted(key for key, item in namespace.values.items() if key.startswith(prefix) and item.live(now))
    page, cursor = _paged(names, request, least=least, limit_arg=limit_arg)
    return [_key_json(name, namespace.values[name]) for name in page], cursor


def _key_json(name: str, item: KvValue) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name}
    if item.expiration is not None:
        entry["expiration"] = item.expiration
    if item.metadata is not None:
        entry["metadata"] = item.metadata
    return entry
