"""The emulated account's Worker scripts: upload, delete, list, settings, and the
workers.dev subdomain (the account's and each script's)."""

from __future__ import annotations

import re
import time
from typing import Any

from cfemulator.api_common import (
    _LABEL,
    ApiRequest,
    ApiResponse,
    _check_name,
    _ok,
    _settings,
    _tags_match,
    _upload_result,
)
from cfemulator.api_lifecycle import upload_source
from cfemulator.envelope import ApiError
from cfemulator.state import Script


class ScriptEndpoints:
    """The Worker script endpoints of `CloudflareApi` (a mixin: the account's state, lock and
    config are the API's)."""

    # --- Worker scripts -----------------------------------------------------------------------

    def _script_list(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        # `tags=a:yes,b:no` filters as on a namespace's list (`ScriptListParams.tags` in
        # cloudflare-python; the account's list takes it too).
        selector = request.arg("tags", "") or ""
        return _ok([script.to_json() for script in self.scripts.values() if _tags_match(script, selector)])

    def _script_upload(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        name = _check_name(params["script"])
        existing = self.scripts.get(name)
        if existing is None and len(self.scripts) >= self._config.script_limit:
            # Checked under the lock, so concurrent uploads never overshoot the quota.
            raise ApiError(
                400, 10037, f"You have exceeded the limit of {self._config.script_limit} Workers on your account."
            )
        script = self._upload_stored(name, params["upload"], existing)
        if existing is None:
            self.scripts[name] = script
        self._record_upload(script, script.upload, deployed=True, source=upload_source(request))
        return _ok(_upload_result(script))

    def _script_delete(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self.scripts.pop(params["script"], None)
        if script is None:
            raise ApiError(404, 10007)
        self._forget_versions(script)
        self._release(script.sha)
        return _ok(None)

    def _script_settings(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(_settings(self._script(params["script"])))

    def _script_subdomain_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._propagated_script(params["script"])
        return _ok({"enabled": script.subdomain_enabled, "previews_enabled": script.previews_enabled})

    def _script_subdomain_set(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._propagated_script(params["script"])
        body = request.json()
        if not isinstance(body, dict) or not isinstance(body.get("enabled"), bool):
            raise ApiError(400, 10021, "enabled (true or false) is required")
        if body["enabled"] != script.subdomain_enabled:
            script.route_live_at = time.time() + self._config.propagation_delay
        script.subdomain_enabled = body["enabled"]
        script.previews_enabled = bool(body.get("previews_enabled", False))
        return _ok({"enabled": script.subdomain_enabled, "previews_enabled": script.previews_enabled})

    def _script_subdomain_delete(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._propagated_script(params["script"])
        script.subdomain_enabled = script.previews_enabled = False
        return _ok({"enabled": False, "previews_enabled": False})

    def _subdomain_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        if not self.subdomain:
            raise ApiError(404, 10007, "This account has no workers.dev subdomain.")
        return _ok({"subdomain": self.subdomain})

    def _subdomain_put(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        body = request.json()
        name = body.get("subdomain") if isinstance(body, dict) else None
        if not isinstance(name, str) or not re.fullmatch(_LABEL, name):
            raise ApiError(400, 10021, "subdomain must be one lowercase DNS label")
        self.subdomain = name
        return _ok({"subdomain": name})

    def _propagated_script(self, name: str) -> Script:
        """The script, as the workers.dev subdomain endpoints see it: a first upload still
        propagating is 10007 to all three of them alike (reference §3.2), never found by one
        and missing to another."""
        script = self._script(name)
        if not script.serves(time.time()):
            raise ApiError(404, 10007)
        return script

    def _script(self, name: str) -> Script:
        script = self.scripts.get(name)
        if script is None:
            raise ApiError(404, 10007)
        return script
