"""A Worker script's lifecycle as wrangler and the official SDK drive it: the service a script
belongs to, its versions and deployments, its code alone, its secrets, its script-level
settings, and the account's identity (user, accounts, memberships) and Workers settings.

Shapes follow cloudflare/api-schemas as cloudflare-python types them, and the fields wrangler
reads (`ApiVersion`, `ApiDeployment`, the service's `default_environment`). The emulator
serves one version of a script at a time: a deployment must give one version 100%.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import replace
from typing import Any

from cfemulator.api_common import ApiRequest, ApiResponse, _int_arg, _now, _ok
from cfemulator.envelope import ApiError
from cfemulator.state import Script
from cfemulator.uploads import ScriptUpload, TextBinding

# Whom the emulated account's token belongs to.
USER_EMAIL = "owner@sigil.localhost"
ACCOUNT_NAME = "Sigil emulator"
SECRET_TYPES = ("secret_text", "secret_key")
_DEFAULT_ACCOUNT_SETTINGS = {"default_usage_model": "standard", "green_compute": False}


class LifecycleEndpoints:
    """The lifecycle endpoints of `CloudflareApi` (a mixin: the account's state, lock and
    config are the API's)."""

    # --- versions and deployments (kept as each upload and deployment makes them) -----------

    def _record_upload(self, script: Script, upload: ScriptUpload, *, deployed: bool, source: str) -> dict[str, Any]:
        """Record a version of `script` made of `upload` (deployed at once, or not): its id is
        the script's deployment id when deployed, as wrangler reads it from an upload's answer."""
        version_id = script.deployment_id if deployed else str(uuid.uuid4())
        version = {
            "id": version_id,
            "number": len(script.versions) + 1,
            "metadata": {
                "author_email": USER_EMAIL,
                "author_id": _user_id(self._token),
                "created_on": _now(),
                "modified_on": _now(),
                "source": source,
                "hasPreview": False,
            },
            "annotations": {},
            # A version not deployed yet has its bundle written too (its etag is that bundle's
            # sha, as the script's will be once it is deployed).
            "resources": _resources(script.sha if deployed else self._write_bundle(upload), upload, source),
        }
        script.versions = (*script.versions, version)
        self._version_uploads[version_id] = upload
        if deployed:
            self._record_deployment(script, version_id, source=source, message=None)
        return version

    def _record_deployment(self, script: Script, version_id: str, *, source: str, message: str | None) -> dict:
        script.last_deployed_from = source
        deployment = {
            "id": str(uuid.uuid4()),
            "created_on": _now(),
            "source": source,
            "strategy": "percentage",
            "author_email": USER_EMAIL,
            "annotations": {"workers/message": message} if message else {},
            "versions": [{"version_id": version_id, "percentage": 100.0}],
        }
        script.deployments = (deployment, *script.deployments)
        return deployment

    def _version_upload(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._script(params["script"])
        # A version inherits the secrets of the one before it (unless it binds their names):
        # wrangler's deploy names none and leaves them in place (workers-sdk #5296, and its
        # check of local names against remote secrets before a deploy).
        upload: ScriptUpload = params["upload"]
        upload = replace(upload, keep_bindings=tuple(dict.fromkeys((*upload.keep_bindings, *SECRET_TYPES))))
        upload = self._checked(script.name, upload, script)
        version = self._record_upload(script, upload, deployed=False, source=upload_source(request))
        return _ok({**version, "startup_time_ms": 0})

    def _version_list(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        versions = list(reversed(self._script(params["script"]).versions))
        page, per_page = _page_args(request)
        items = versions[(page - 1) * per_page : page * per_page]
        return _ok({"items": items}, result_info={"page": page, "per_page": per_page, "total_count": len(versions)})

    def _version_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(self._version(self._script(params["script"]), params["version"]))

    def _deployment_list(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok({"deployments": list(self._script(params["script"]).deployments)})

    def _deployment_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        for deployment in self._script(params["script"]).deployments:
            if deployment["id"] == params["deployment"]:
                return _ok(deployment)
        raise ApiError(404, 10007, "Deployment not found.")

    def _deployment_create(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._script(params["script"])
        body = request.json()
        if not isinstance(body, dict) or body.get("strategy") != "percentage":
            raise ApiError(400, 10021, 'a deployment is {"strategy": "percentage", "versions": [...]}')
        versions = body.get("versions")
        if not isinstance(versions, list) or not all(isinstance(v, dict) for v in versions) or not versions:
            raise ApiError(400, 10021, 'a deployment\'s versions are [{"version_id": ..., "percentage": ...}]')
        if len(versions) != 1 or versions[0].get("percentage") != 100:
            # Cloudflare splits traffic between two versions; the emulator serves one.
            raise ApiError(400, 10021, "the emulator deploys one version at 100%; a split deployment is not kept")
        version_id = str(versions[0].get("version_id", ""))
        self._version(script, version_id)
        upload = self._version_uploads.get(version_id)
        if upload is None:
            raise ApiError(400, 10021, f"the code of version {version_id} is no longer kept by the emulator")
        if version_id != script.deployment_id:
            self._store(script.name, upload, script, propagates=False)
            script.deployment_id = version_id
        annotations = body.get("annotations") or {}
        message = annotations.get("workers/message") if isinstance(annotations, dict) else None
        return _ok(self._record_deployment(script, version_id, source=upload_source(request), message=message))

    def _forget_versions(self, script: Script) -> None:
        for version in script.versions:
            self._version_uploads.pop(version["id"], None)

    def _version(self, script: Script, version_id: str) -> dict[str, Any]:
        for version in script.versions:
            if version["id"] == version_id:
                return version
        raise ApiError(404, 10007, "Version not found.")

    # --- the service (wrangler's view of a script) ----------------------------------------------

    def _service_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._script(params["script"])
        return _ok(
            {
                "id": script.name,
                "created_on": script.created_on,
                "modified_on": script.modified_on,
                "default_environment": {
                    "environment": "production",
                    "created_on": script.created_on,
                    "modified_on": script.modified_on,
                    "script": {
                        **script.to_json(),
                        "tag": _script_tag(script),
                        "tags": script.upload.tags or None,
                        "last_deployed_from": script.last_deployed_from,
                    },
                },
                "environments": [{"environment": "production"}],
            }
        )

    # --- the code alone ---------------------------------------------------------------------------

    def _content_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        upload = self._script(params["script"]).upload
        module = upload.loader_modules[upload.main_module]
        source = module if isinstance(module, str) else next(iter(module.values()))
        return ApiResponse(
            200,
            source.encode(),
            [("cf-entrypoint", upload.main_module)],
            content_type=upload.module_types[upload.main_module],
        )

    def _content_put(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._script(params["script"])
        code: ScriptUpload = params["upload"]
        # The code only: date, flags, bindings and the rest stay as the script has them.
        upload = replace(
            script.upload,
            main_module=code.main_module,
            module_types=code.module_types,
            loader_modules=code.loader_modules,
            size_compressed=code.size_compressed,
        )
        return _ok(self._deploy_change(script, upload, request).to_json())

    def _deploy_change(self, script: Script, upload: ScriptUpload, request: ApiRequest) -> Script:
        """Deploy `upload` as a new version of `script`, as a change of its code or secrets does."""
        upload = self._checked(script.name, replace(upload, keep_bindings=()), script)
        self._store(script.name, upload, script, propagates=False)
        self._record_upload(script, upload, deployed=True, source=upload_source(request))
        return script

    # --- secrets ------------------------------------------------------------------------------------

    def _secret_put(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._script(params["script"])
        body = request.json()
        if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
            raise ApiError(400, 10052, "A binding was uploaded without a name")
        name, text, kind = body["name"], body.get("text"), body.get("type", "secret_text")
        if kind != "secret_text" or not isinstance(text, str):
            raise ApiError(400, 10021, 'a secret is {"name": ..., "text": ..., "type": "secret_text"}')
        for binding in script.upload.bindings:
            if binding["name"] == name and binding["type"] not in SECRET_TYPES:
                raise ApiError(400, 10053, f"Binding name '{name}' already in use.")
        upload = _without_binding(script.upload, name)
        upload = replace(
            upload,
            bindings=[*upload.bindings, {"name": name, "type": kind, "text": text}],
            text_bindings=(*upload.text_bindings, TextBinding(name=name, value=text, secret=True)),
        )
        self._deploy_change(script, upload, request)
        return _ok({"name": name, "type": kind})

    def _secret_list(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(_secrets(self._script(params["script"])))

    def _secret_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(self._secret(self._script(params["script"]), params["secret"]))

    def _secret_delete(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._script(params["script"])
        self._secret(script, params["secret"])
        self._deploy_change(script, _without_binding(script.upload, params["secret"]), request)
        return _ok(None)

    @staticmethod
    def _secret(script: Script, name: str) -> dict[str, str]:
        for secret in _secrets(script):
            if secret["name"] == name:
                return secret
        raise ApiError(404, 10056, f"Binding '{name}' not found.")

    # --- script-level settings (not versioned) --------------------------------------------------

    def _script_settings_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(_script_settings(self._script(params["script"])))

    def _script_settings_patch(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        script = self._script(params["script"])
        body = request.json()
        if not isinstance(body, dict):
            raise ApiError(400, 10026, "The request body could not be parsed: settings must be a JSON object")
        upload = script.upload
        if "tags" in body:
            tags = body["tags"] or []
            if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
                raise ApiError(400, 10021, "tags must be a list of strings")
            upload = replace(upload, tags=list(tags))
        if "tail_consumers" in body:
            consumers = body["tail_consumers"] or []
            if not isinstance(consumers, list) or not all(
                isinstance(c, dict) and isinstance(c.get("service"), str) for c in consumers
            ):
                raise ApiError(400, 10021, 'each tail consumer names its Worker: {"service": name}')
            upload = replace(upload, tail_consumers=tuple(dict(c) for c in consumers))
        if "logpush" in body:
            script.logpush = bool(body["logpush"])
        if isinstance(body.get("observability"), dict):
            script.observability = dict(body["observability"])
        script.upload = upload
        return _ok(_script_settings(script))

    # --- the account --------------------------------------------------------------------------------

    def _user_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(
            {
                "id": _user_id(self._token),
                "email": USER_EMAIL,
                "first_name": None,
                "last_name": None,
                "suspended": False,
                "two_factor_authentication_enabled": False,
                "has_pro_zones": False,
                "has_business_zones": False,
                "has_enterprise_zones": False,
            }
        )

    def _account_list(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _page_of([self._account_json()], request)

    def _account_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(self._account_json())

    def _membership_list(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        membership = {
            "id": hashlib.sha256(f"membership:{self.account_id}".encode()).hexdigest()[:32],
            "account": {"id": self.account_id, "name": ACCOUNT_NAME},
            "roles": ["Super Administrator - All Privileges"],
            "status": "accepted",
        }
        return _page_of([membership], request)

    def _account_json(self) -> dict[str, Any]:
        return {
            "id": self.account_id,
            "name": ACCOUNT_NAME,
            "type": "standard",
            "created_on": "2025-01-01T00:00:00Z",
            "settings": {"enforce_twofactor": False},
        }

    def _account_settings_get(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        return _ok(dict(self.account_settings))

    def _account_settings_put(self, request: ApiRequest, params: dict[str, Any]) -> ApiResponse:
        body = request.json()
        if not isinstance(body, dict) or not set(body) <= set(_DEFAULT_ACCOUNT_SETTINGS):
            raise ApiError(400, 10021, f"account settings are {sorted(_DEFAULT_ACCOUNT_SETTINGS)}")
        if body.get("default_usage_model", "standard") not in ("standard", "bundled", "unbound"):
            raise ApiError(400, 10021, "default_usage_model is standard, bundled or unbound")
        self.account_settings = {**self.account_settings, **body}
        return _ok(dict(self.account_settings))


def default_account_settings() -> dict[str, Any]:
    return dict(_DEFAULT_ACCOUNT_SETTINGS)


def _resources(etag: str, upload: ScriptUpload, source: str) -> dict[str, Any]:
    bindings = [
        {k: v for k, v in b.items() if not (b.get("type") in SECRET_TYPES and k == "text")} for b in upload.bindings
    ]
    return {
        "script": {"etag": etag, "handlers": ["fetch"], "last_deployed_from": source},
        "script_runtime": {
            "compatibility_date": upload.compatibility_date,
            "compatibility_flags": upload.compatibility_flags,
            "usage_model": "standard",
            "limits": upload.limits,
        },
        "bindings": bindings,
    }


def _script_settings(script: Script) -> dict[str, Any]:
    return {
        "logpush": script.logpush,
        "observability": script.observability or {"enabled": False},
        "tags": script.upload.tags,
        "tail_consumers": [dict(consumer) for consumer in script.upload.tail_consumers],
    }


def _secrets(script: Script) -> list[dict[str, str]]:
    return [{"name": b["name"], "type": b["type"]} for b in script.upload.bindings if b["type"] in SECRET_TYPES]


def _without_binding(upload: ScriptUpload, name: str) -> ScriptUpload:
    return replace(
        upload,
        bindings=[b for b in upload.bindings if b["name"] != name],
        text_bindings=tuple(t for t in upload.text_bindings if t.name != name),
    )


def upload_source(request: ApiRequest) -> str:
    # Cloudflare tells wrangler's uploads from other API calls; its user agent says which.
    return "wrangler" if request.headers.get("user-agent", "").startswith("wrangler") else "api"


def _script_tag(script: Script) -> str:
    # A script's tag is an id of its own, stable for its life (a new script, a new tag).
    return hashlib.sha256(f"{script.name}:{script.created_on}".encode()).hexdigest()[:32]


def _user_id(token: str) -> str:
    return hashlib.sha256(f"user:{token}".encode()).hexdigest()[:32]


def _page_args(request: ApiRequest) -> tuple[int, int]:
    return max(1, _int_arg(request, "page", 1)), min(100, max(1, _int_arg(request, "per_page", 20)))


def _page_of(items: list[Any], request: ApiRequest) -> ApiResponse:
    page, per_page = _page_args(request)
    shown = items[(page - 1) * per_page : page * per_page]
    info = {
        "page": page,
        "per_page": per_page,
        "count": len(shown),
        "total_count": len(items),
        "total_pages": max(1, -(-len(items) // per_page)),
    }
    return _ok(shown, result_info=info)
