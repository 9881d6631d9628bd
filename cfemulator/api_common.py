"""What the emulated endpoints share: the request and response they handle, and the
helpers that read a request and write Cloudflare's answers."""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cfemulator import envelope
from cfemulator.envelope import ApiError
from cfemulator.state import DispatchNamespace, KvNamespace, Script

# Cloudflare's schema pattern (§1.5) with the documented 63-character bound of a DNS label.
_SCRIPT_NAME = re.compile(r"^[a-z0-9_][a-z0-9_-]{0,62}$")
_LABEL = r"[a-z0-9_][a-z0-9_-]{0,62}"
_KV_MIN_TTL_SECONDS = 60


@dataclass(frozen=True)
class ApiRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes

    def arg(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[0] if values else default

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, 10026, f"The request body could not be parsed: {exc}") from exc


@dataclass(frozen=True)
class ApiResponse:
    status: int
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_type: str = "application/json"


# --- helpers ------------------------------------------------------------------------------------


def _ok(result: Any, **extra: Any) -> ApiResponse:
    return ApiResponse(200, envelope.success(result, **extra))


def _error_response(error: ApiError, headers: list[tuple[str, str]] | None = None) -> ApiResponse:
    return ApiResponse(error.status, envelope.failure(error.code, error.message), list(headers or []))


def _fault_response(status: int) -> ApiResponse:
    if status == 502:
        # What an edge proxy answers: HTML, not an envelope; clients must cope with both.
        page = b"<html><head><title>502 Bad Gateway</title></head><body>502 Bad Gateway</body></html>"
        return ApiResponse(502, page, content_type="text/html")
    return ApiResponse(status, envelope.failure(10002, "Unexpected internal server error"))


def _upload_result(script: Script) -> dict[str, Any]:
    return {
        **script.to_json(),
        # Each upload deploys a new version at once; Wrangler reads its deployment's id here.
        "deployment_id": script.deployment_id,
        "handlers": ["fetch"],
        "startup_time_ms": 0,
        "compatibility_date": script.upload.compatibility_date,
        "compatibility_flags": script.upload.compatibility_flags,
    }


def _ns_script_json(namespace: DispatchNamespace, script: Script) -> dict[str, Any]:
    """A namespace script as Cloudflare lists and shows it: the name nests in `script.id`
    (`namespace-worker-list-scripts` in cloudflare/api-schemas)."""
    return {
        "created_on": script.created_on,
        "modified_on": script.modified_on,
        "dispatch_namespace": namespace.name,
        "script": {**script.to_json(), "tags": script.upload.tags},
    }


def _settings(script: Script) -> dict[str, Any]:
    # Secret values are write-only on Cloudflare: settings name them but never show them.
    bindings = [
        {k: v for k, v in b.items() if not (b.get("type") == "secret_text" and k == "text")}
        for b in script.upload.bindings
    ]
    return {
        "bindings": bindings,
        "compatibility_date": script.upload.compatibility_date,
        "compatibility_flags": script.upload.compatibility_flags,
        "limits": script.upload.limits,
        "logpush": script.logpush,
        "tags": script.upload.tags,
        "tail_consumers": [dict(consumer) for consumer in script.upload.tail_consumers],
        "usage_model": "standard",
    }


def _kv_namespace_json(namespace: KvNamespace) -> dict[str, Any]:
    return {"id": namespace.id, "title": namespace.title, "supports_url_encoding": True}


def _check_name(name: str) -> str:
    if not _SCRIPT_NAME.match(name):
        raise ApiError(400, 10016, f"Invalid Worker name {name!r}")
    return name


def _check_key(key: str) -> str:
    if not key or len(key.encode()) > 512:
        raise ApiError(400, 10021, "a KV key is 1 to 512 bytes")
    return key


def _tags_match(script: Script, selector: str) -> bool:
    """`tags=a:yes,b:no` (reference §4.2): every `yes` tag present, every `no` tag absent."""
    for clause in filter(None, selector.split(",")):
        tag, _, wanted = clause.partition(":")
        present = tag in script.upload.tags
        if present != (wanted != "no"):
            return False
    return True


def _int_arg(request: ApiRequest, name: str, default: int) -> int:
    raw = request.arg(name)
    return default if raw in (None, "") else _int_value(raw, name)


def _paged(items: list[Any], request: ApiRequest, *, least: int, limit_arg: str = "limit") -> tuple[list[Any], str]:
    """The page of `items` that the argument `limit_arg` (at least `least`, at most 1000)
    and `cursor` (an offset) ask for, and the next page's cursor ("" after the last)."""
    limit = min(1000, max(least, _int_arg(request, limit_arg, 1000)))
    offset = _int_arg(request, "cursor", 0)
    cursor = str(offset + limit) if offset + limit < len(items) else ""
    return items[offset : offset + limit], cursor


def _int_value(raw: str, name: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, 10004, f"Malformed URL parameter {name}={raw!r}") from None


def _same(given: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(given, expected)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
