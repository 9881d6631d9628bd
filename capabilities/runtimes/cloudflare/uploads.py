"""A Worker script's upload as Cloudflare reads it: the multipart parts, each module's content
type, and a declared binding in the upload metadata's words."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from capabilities.runtimes.base import ResolvedBinding

# Modules of Sigil's that the entry modules it uploads import, each uploaded beside them under
# its file's name: the constant-time check of Sigil's secret, and the capability's default
# export as the entry modules in front of it see it (refused at start when it is none).
SECRET_MODULE = "sigil-secret.js"
CAPABILITY_MODULE = "sigil-capability.js"
# The capability's secrets masked in its console and its failures (imported first by an entry
# module), which knows them by the names in SECRET_NAMES_BINDING.
MASK_MODULE = "sigil-mask.js"
SECRET_NAMES_BINDING = "SIGIL_SECRET_NAMES"
_HERE = Path(__file__).resolve().parent
_SIGIL_MODULES = {name: (_HERE / name).read_text() for name in (SECRET_MODULE, CAPABILITY_MODULE, MASK_MODULE)}


def sigil_modules(*names: str) -> dict[str, str]:
    """Sigil's modules `names` (SECRET_MODULE, CAPABILITY_MODULE), by name, for an upload."""
    return {name: _SIGIL_MODULES[name] for name in names}


def secret_names_binding(secrets: Mapping[str, str]) -> dict:
    """The plain_text binding naming the bundle's secrets (names only) for MASK_MODULE."""
    return {"type": "plain_text", "name": SECRET_NAMES_BINDING, "text": json.dumps(sorted(secrets))}


# Content types of module parts, by file extension (Wrangler's mapping, reference §1.1).
_MODULE_TYPES = {
    ".js": "application/javascript+module",
    ".mjs": "application/javascript+module",
    ".cjs": "application/javascript",
    ".wasm": "application/wasm",
    ".map": "application/source-map",
    ".txt": "text/plain",
    ".html": "text/plain",
    ".json": "text/plain",
}


def module_content_type(name: str) -> str:
    """The content type of a module part, chosen by the module's file extension."""
    dot = name.rfind(".")
    return _MODULE_TYPES.get(name[dot:].lower() if dot >= 0 else "", "application/octet-stream")


def upload_parts(
    *,
    modules: Mapping[str, str | bytes],
    main_module: str,
    compatibility_date: str,
    compatibility_flags: Sequence[str] = (),
    bindings: Sequence[Mapping[str, Any]] = (),
    tags: Sequence[str] = (),
    limits: Mapping[str, int] | None = None,
    tail_consumers: Sequence[Mapping[str, str]] = (),
) -> list[tuple[str, tuple]]:
    """The multipart parts of a script upload, laid out as Wrangler sends them (reference §1.1).

    `metadata` is a plain form field (no filename, no content type); each module is a part
    whose name and filename are the module's name. Raises ValueError when `main_module` is
    not among `modules`.
    """
    if main_module not in modules:
        raise ValueError(f"main module {main_module!r} is not among the modules")
    metadata: dict[str, Any] = {
        "main_module": main_module,
        "compatibility_date": compatibility_date,
        "bindings": [dict(binding) for binding in bindings],
        "tags": list(tags),
    }
    if compatibility_flags:
        metadata["compatibility_flags"] = list(compatibility_flags)
    if limits:
        metadata["limits"] = dict(limits)
    if tail_consumers:
        # The Tail Workers that receive the script's events: `{"service": name}` each.
        metadata["tail_consumers"] = [dict(consumer) for consumer in tail_consumers]
    parts: list[tuple[str, tuple]] = [("metadata", (None, json.dumps(metadata)))]
    for name, source in modules.items():
        body = source.encode() if isinstance(source, str) else source
        parts.append((name, (name, body, module_content_type(name))))
    return parts


def metadata_binding(binding: ResolvedBinding) -> dict:
    """A declared binding as Cloudflare's upload metadata spells it (reference §1.3)."""
    shapes = {
        "VAR": {"type": "plain_text", "text": binding.value},
        "SECRET": {"type": "secret_text", "text": binding.value},
        "KV": {"type": "kv_namespace", "namespace_id": binding.value},
        "D1": {"type": "d1", "id": binding.value},
        "R2": {"type": "r2_bucket", "bucket_name": binding.value},
        "SERVICE": {"type": "service", "service": binding.value, "environment": "production"},
        "QUEUE": {"type": "queue", "queue_name": binding.value},
    }
    return {"name": binding.name, **shapes[binding.kind]}
