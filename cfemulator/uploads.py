"""Script uploads: the multipart/form-data body of `PUT …/scripts/{name}`, parsed and checked
as Cloudflare does (reference §1.1-1.3), and turned into what the loader host runs."""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from email.message import Message
from email.parser import BytesHeaderParser
from typing import Any

from cfemulator.envelope import ApiError

# Module part content types the API accepts (reference §1.1, from the spec).
ES_MODULE_TYPES = frozenset({"application/javascript+module", "text/javascript+module"})
COMMONJS_TYPES = frozenset({"application/javascript", "text/javascript"})
BINARY_TYPES = frozenset({"application/wasm", "application/octet-stream"})
TEXT_TYPE = "text/plain"
SOURCE_MAP_TYPE = "application/source-map"
ACCEPTED_TYPES = ES_MODULE_TYPES | COMMONJS_TYPES | BINARY_TYPES | {TEXT_TYPE, SOURCE_MAP_TYPE}

# The API's default when an upload names no compatibility date (reference §1.2).
DEFAULT_COMPATIBILITY_DATE = "2021-11-02"
MAX_TAGS = 8
# Environment variables (text and secret together) on the Paid plan, and their size (§1.3).
MAX_TEXT_BINDINGS = 128
MAX_TEXT_BINDING_BYTES = 5 * 1024

BINDING_TYPES = frozenset(
    {
        "plain_text",
        "secret_text",
        "json",
        "kv_namespace",
        "d1",
        "r2_bucket",
        "service",
        "dispatch_namespace",
        "worker_loader",
        "queue",
        "durable_object_namespace",
        "analytics_engine",
        "version_metadata",
        "ai",
        "inherit",
        "secret_key",
    }
)
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_LIMIT_KEYS = frozenset({"cpu_ms", "subrequests"})


@dataclass(frozen=True)
class FormPart:
    """One part of a multipart/form-data body."""

    name: str
    filename: str | None
    content_type: str | None
    body: bytes


@dataclass(frozen=True)
class TextBinding:
    """A plain_text or secret_text binding: a value the script finds in `env` under `name`."""

    name: str
    value: str = field(repr=False)
    secret: bool = False


@dataclass(frozen=True)
class ScriptUpload:
    """A checked upload: its metadata, its modules, and what the loader host is given."""

    main_module: str
    compatibility_date: str
    compatibility_flags: list[str]
    bindings: list[dict[str, Any]]
    tags: list[str]
    limits: dict[str, int]
    # module name -> content type, as uploaded
    module_types: dict[str, str]
    # module name -> the loader's module value (a string for `.js` ES modules)
    loader_modules: dict[str, Any]
    # plain_text and secret_text bindings, as the loader host puts them in `env`
    text_bindings: tuple[TextBinding, ...] = ()
    size_compressed: int = 0
    # Binding types the previous upload's bindings are kept of (metadata.keep_bindings).
    keep_bindings: tuple[str, ...] = ()
    # The Tail Workers that receive this script's events (metadata.tail_consumers), each
    # `{"service": name}` with an optional `environment` and `namespace`, as the SDKs'
    # ConsumerScriptParam types it.
    tail_consumers: tuple[dict[str, str], ...] = ()


def parse_form(content_type: str, body: bytes) -> list[FormPart]:
    """Split a multipart/form-data body into its parts, strictly.

    Raises ApiError 10001 when the body is not multipart/form-data, 10026 when it is
    malformed (no boundary, a part without a name, no closing delimiter).
    """
    header = Message()
    header["content-type"] = content_type or ""
    if header.get_content_type() != "multipart/form-data":
        raise ApiError(
            400, 10001, f"Unsupported or unexpected Content Type {content_type!r}; expected multipart/form-data"
        )
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise ApiError(400, 10026, "The request body could not be parsed: no multipart boundary")
    delimiter = b"--" + boundary.encode("latin-1")
    start = body.find(delimiter)
    if start < 0 or (start > 0 and body[start - 2 : start] != b"\r\n"):
        raise ApiError(400, 10026, "The request body could not be parsed: the boundary is not in the body")
    parts: list[FormPart] = []
    position = start + len(delimiter)
    while True:
        if body.startswith(b"--", position):
            return parts
        line_end = body.find(b"\r\n", position)
        # Only transport padding (spaces, tabs) may follow a delimiter before its CRLF.
        if line_end < 0 or body[position:line_end].strip(b" \t"):
            raise ApiError(400, 10026, "The request body could not be parsed: a malformed multipart delimiter")
        part_start = line_end + 2
        part_end = body.find(b"\r\n" + delimiter, part_start)
        if part_end < 0:
            raise ApiError(
                400, 10026, "The request body could not be parsed: the closing multipart delimiter is missing"
            )
        parts.append(_parse_part(body[part_start:part_end]))
        position = part_end + 2 + len(delimiter)


def _parse_part(raw: bytes) -> FormPart:
    if raw.startswith(b"\r\n"):
        head, content = b"", raw[2:]
    else:
        head_end = raw.find(b"\r\n\r\n")
        if head_end < 0:
            raise ApiError(400, 10026, "The request body could not be parsed: a multipart part has no header end")
        head, content = raw[:head_end], raw[head_end + 4 :]
    headers = BytesHeaderParser().parsebytes(head + b"\r\n\r\n")
    if headers.get_content_disposition() != "form-data":
        raise ApiError(400, 10026, "The request body could not be parsed: a part is not form-data")
    name = headers.get_param("name", header="content-disposition")
    if not isinstance(name, str) or not name:
        raise ApiError(400, 10026, "The request body could not be parsed: a form-data part has no name")
    content_type = headers.get_content_type() if headers["content-type"] else None
    return FormPart(name=name, filename=headers.get_filename(), content_type=content_type, body=content)


def parse_upload(content_type: str, body: bytes, *, max_compressed_bytes: int) -> ScriptUpload:
    """Parse and check a script upload.

    Accepts Wrangler's layout (one part per module, named after it) and the Python SDK's
    (`files` parts whose filename is the module name); `metadata` with or without a content
    type (reference §1.1). Raises ApiError with Cloudflare's code for each failure.
    """
    parts = parse_form(content_type, body)
    metadata_parts = [part for part in parts if part.name == "metadata"]
    if not metadata_parts:
        # The reference names no code for this; an upload without metadata cannot be read.
        raise ApiError(400, 10026, "The request body could not be parsed: there is no metadata part")
    try:
        metadata = json.loads(metadata_parts[0].body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, 10026, f"The request body could not be parsed: metadata is not JSON ({exc})") from exc
    if not isinstance(metadata, dict):
        raise ApiError(400, 10026, "The request body could not be parsed: metadata must be a JSON object")

    modules: dict[str, FormPart] = {}
    for part in parts:
        if part is metadata_parts[0]:
            continue
        modules[part.filename or part.name] = part

    main_module = metadata.get("main_module")
    if not isinstance(main_module, str) or not main_module:
        if metadata.get("body_part"):
            raise ApiError(400, 10021, "Service-worker syntax (body_part) is not supported here; upload an ES module")
        raise ApiError(400, 10021, "metadata.main_module is required for a module Worker")
    if main_module not in modules:
        # workerd's own wording when an entry point is missing.
        raise ApiError(400, 10021, f'Uncaught Error: No such module "{main_module}".')

    module_types: dict[str, str] = {}
    loader_modules: dict[str, Any] = {}
    size = 0
    for name, part in modules.items():
        kind = part.content_type or _type_from_extension(name)
        if kind not in ACCEPTED_TYPES:
            raise ApiError(400, 10001, f"Unsupported or unexpected Content Type {kind!r} for module {name!r}")
        module_types[name] = kind
        size += len(zlib.compress(part.body, 6))
        if kind == SOURCE_MAP_TYPE:
            continue  # kept by Cloudflare for stack traces; not a module
        if kind in BINARY_TYPES:
            # The loader host receives modules as JSON, which cannot carry bytes.
            raise ApiError(400, 10021, f"module {name!r}: the emulator runs JavaScript and text modules only")
        try:
            source = part.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, 10006, f"Unparseable script body: module {name!r} is not UTF-8") from exc
        loader_modules[name] = _loader_module(name, kind, source)
    if module_types[main_module] not in ES_MODULE_TYPES:
        raise ApiError(400, 10021, f"main module {main_module!r} must be an ES module (application/javascript+module)")
    if size > max_compressed_bytes:
        raise ApiError(
            400, 10027, f"Script body was too large: {size} bytes compressed, the limit is {max_compressed_bytes}"
        )

    compatibility_date = metadata.get("compatibility_date") or DEFAULT_COMPATIBILITY_DATE
    if not isinstance(compatibility_date, str) or not _DATE.match(compatibility_date):
        raise ApiError(400, 10021, f"compatibility_date must be YYYY-MM-DD, not {compatibility_date!r}")
    flags = _string_list(metadata, "compatibility_flags")
    tags = _string_list(metadata, "tags")
    if len(tags) > MAX_TAGS:
        raise ApiError(400, 10021, f"a script may have at most {MAX_TAGS} tags, not {len(tags)}")
    bindings, text_bindings = _check_bindings(metadata.get("bindings", []))
    return ScriptUpload(
        main_module=main_module,
        compatibility_date=compatibility_date,
        compatibility_flags=flags,
        bindings=bindings,
        tags=tags,
        limits=_check_limits(metadata.get("limits")),
        module_types=module_types,
        loader_modules=loader_modules,
        text_bindings=text_bindings,
        size_compressed=size,
        keep_bindings=_keep_bindings(metadata),
        tail_consumers=_check_tail_consumers(metadata.get("tail_consumers")),
    )


def _type_from_extension(name: str) -> str:
    # A part without a content type would be text/plain by RFC 7578; whether Cloudflare then
    # goes by the extension is UNCERTAIN. Going by it keeps bare `.js` parts runnable.
    if name.endswith((".js", ".mjs")):
        return "application/javascript+module"
    return TEXT_TYPE


def _loader_module(name: str, kind: str, source: str) -> Any:
    """The Worker Loader's module value: plain strings only for `.js` ES modules (§5.3)."""
    if kind in ES_MODULE_TYPES:
        return source if name.endswith(".js") else {"js": source}
    if kind in COMMONJS_TYPES:
        return {"cjs": source}
    return {"text": source}


def _string_list(metadata: dict[str, Any], key: str) -> list[str]:
    value = metadata.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ApiError(400, 10021, f"metadata.{key} must be a list of strings")
    return list(value)


def _check_bindings(raw: Any) -> tuple[list[dict[str, Any]], tuple[TextBinding, ...]]:
    """Check the bindings; return them, and the text bindings the loader host can give the script.

    Only text values (plain_text, secret_text) reach a script run by the loader host, which
    has no KV, service or dispatch bindings to hand out; a script binding a KV namespace, a
    Worker Loader or a dispatch namespace runs from a workerd config of its own (`cfemulator.bound`).
    """
    if not isinstance(raw, list):
        raise ApiError(400, 10021, "metadata.bindings must be a list")
    texts: list[TextBinding] = []
    for binding in raw:
        if not isinstance(binding, dict):
            raise ApiError(400, 10021, "each binding must be an object")
        name = binding.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, 10052, "A binding was uploaded without a name")
        kind = binding.get("type")
        if kind not in BINDING_TYPES:
            raise ApiError(400, 10021, f"binding {name} of type {kind} is invalid")
        if kind in ("plain_text", "secret_text"):
            text = binding.get("text")
            if not isinstance(text, str):
                raise ApiError(400, 10021, f"binding {name} of type {kind} needs a text value")
            if len(text.encode()) > MAX_TEXT_BINDING_BYTES:
                raise ApiError(400, 10054, f"binding {name} is over {MAX_TEXT_BINDING_BYTES} bytes")
            texts.append(TextBinding(name=name, value=text, secret=kind == "secret_text"))
        for kind_with_target, key in (("kv_namespace", "namespace_id"), ("dispatch_namespace", "namespace")):
            if kind == kind_with_target and not (isinstance(binding.get(key), str) and binding[key]):
                raise ApiError(400, 10021, f"binding {name} of type {kind} is invalid: {key} is required")
    if len(texts) > MAX_TEXT_BINDINGS:
        raise ApiError(400, 10055, f"at most {MAX_TEXT_BINDINGS} environment variables and secrets, not {len(texts)}")
    return [dict(binding) for binding in raw], tuple(texts)


def _keep_bindings(metadata: dict[str, Any]) -> tuple[str, ...]:
    # Binding types, as the SDKs type it ("list of binding types to keep from the previous
    # upload"); whether Cloudflare refuses a type it does not know is in no source, so one
    # simply keeps nothing.
    return tuple(_string_list(metadata, "keep_bindings"))


def _check_tail_consumers(raw: Any) -> tuple[dict[str, str], ...]:
    # ConsumerScriptParam: `service` is required, `environment` and `namespace` optional strings.
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ApiError(400, 10021, "metadata.tail_consumers must be a list")
    consumers = []
    for consumer in raw:
        if not isinstance(consumer, dict) or not isinstance(consumer.get("service"), str) or not consumer["service"]:
            raise ApiError(400, 10021, 'each tail consumer names its Worker: {"service": name}')
        if not set(consumer) <= {"service", "environment", "namespace"} or not all(
            isinstance(value, str) for value in consumer.values()
        ):
            raise ApiError(400, 10021, "a tail consumer holds only the strings service, environment and namespace")
        consumers.append(dict(consumer))
    return tuple(consumers)


def _check_limits(raw: Any) -> dict[str, int]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not set(raw) <= _LIMIT_KEYS:
        raise ApiError(400, 10021, f"metadata.limits may hold only {sorted(_LIMIT_KEYS)}")
    for key, value in raw.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ApiError(400, 10021, f"metadata.limits.{key} must be a positive whole number")
    return dict(raw)
