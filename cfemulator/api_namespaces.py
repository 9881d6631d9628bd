"""The emulated account's Workers for Platforms: dispatch namespaces and their scripts."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from cfemulator.api_common import (
    ApiRequest,
    ApiResponse,
    _check_name,
    _now,
    _ns_script_json,
    _ok,
    _paged,
    _tags_match,
    _upload_result,
)
from cfemulator.envelope import ApiError
from cfemulator.state import DispatchNamespace, Script


class NamespaceEndpoints:
    """The dispatch namespace endpoints of `CloudflareApi` (a mixin: the account's state, lock
    and config are the API's)."""

    # --- dispatch namespaces ------------------------------------------------------------------

    def _namespace_list(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok([self._namespace_json(ns) for ns in self.namespaces.values()])

    def _namespace_create(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        body = request.json()
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name or "/" in name:
            raise ApiError(400, 10021, "name is required")
        if name in self.namespaces:
            # Cloudflare answers 400; no source gives the code, so this keeps KV's (10014).
            raise ApiError(400, 10014, f"a dispatch namespace named {name!r} already exists")
        stamp = _now()
        self.namespaces[name] = DispatchNamespace(id=str(uuid.uuid4()), name=name, created_on=stamp, modified_on=stamp)
        return _ok(self._namespace_json(self.namespaces[name]))

    def _namespace_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(self._namespace_json(self._namespace(params["namespace"])))

    def _namespace_delete(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        namespace = self._namespace(params["namespace"])
        del self.namespaces[namespace.name]
        for script in namespace.scripts.values():
            self._release(script.sha)
        return _ok(None)

    def _ns_script_list(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        namespace = self._namespace(params["namespace"])
        matching = [s for s in namespace.scripts.values() if _tags_match(s, request.arg("tags", "") or "")]
        page, cursor = _paged(matching, request, least=1)
        items = [_ns_script_json(namespace, s) for s in page]
        return _ok(items, result_info={"count": len(items), "cursor": cursor})

    def _ns_script_bulk_delete(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        namespace = self._namespace(params["namespace"])
        selector = request.arg("tags", "") or ""
        if not selector:
            raise ApiError(400, 10021, "tags is required to delete scripts in bulk")
        for name in [n for n, s in namespace.scripts.items() if _tags_match(s, selector)]:
            self._release(namespace.scripts.pop(name).sha)
        return _ok(None)

    def _ns_script_upload(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        namespace = self._namespace(params["namespace"])
        name = _check_name(params["script"])
        # Namespaces are not capped by the account's Worker quota (reference §7.3).
        existing = namespace.scripts.get(name)
        # A first upload to a namespace is deployed synchronously: its 200 means it can be
        # dispatched to at once (Cloudflare's changelog, 2025-02-20).
        script = self._upload_stored(name, params["upload"], existing, propagates=False)
        namespace.scripts[name] = script
        namespace.modified_on = script.modified_on
        return _ok(_upload_result(script))

    def _ns_script_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        namespace = self._namespace(params["namespace"])
        return _ok(_ns_script_json(namespace, self._ns_script(namespace, params["script"])))

    def _ns_script_delete(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        namespace = self._namespace(params["namespace"])
        script = self._ns_script(namespace, params["script"])
        del namespace.scripts[script.name]
        self._release(script.sha)
        return _ok(None)

    def _ns_script_tags_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        namespace = self._namespace(params["namespace"])
        return _ok(list(self._ns_script(namespace, params["script"]).upload.tags))

    def _ns_script_tags_put(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        namespace = self._namespace(params["namespace"])
        script = self._ns_script(namespace, params["script"])
        tags = request.json()
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags) or len(tags) > 8:
            raise ApiError(400, 10021, "tags must be a list of at most 8 strings")
        script.upload = replace(script.upload, tags=list(tags))
        return _ok(list(tags))

    def _namespace(self, name: str) -> DispatchNamespace:
        namespace = self.namespaces.get(name)
        if namespace is None:
            raise ApiError(404, self._config.namespace_not_found_code, f"dispatch namespace {name!r} not found")
        return namespace

    @staticmethod
    def _ns_script(namespace: DispatchNamespace, name: str) -> Script:
        script = namespace.scripts.get(name)
        if script is None:
            raise ApiError(404, 10007, "Worker not found.")
        return script

    def _namespace_json(self, namespace: DispatchNamespace) -> dict[str, Any]:
        return {
            "namespace_id": namespace.id,
            "namespace_name": namespace.name,
            "created_on": namespace.created_on,
            "created_by": self.account_id,
            "modified_on": namespace.modified_on,
            "modified_by": self.account_id,
            "script_count": len(namespace.scripts),
        }
