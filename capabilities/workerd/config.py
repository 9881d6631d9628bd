"""The capnp config of a workerd serving the loader host (`capabilities/runtimes/host/host.js`)."""

from __future__ import annotations

import json
from pathlib import Path

HOST_DIR = Path(__file__).resolve().parent.parent / "runtimes" / "host"
COMPATIBILITY_DATE = "2025-01-01"
# Every V8 collection a full one. Each request leaves native objects (its Request, Response,
# headers, I/O state) behind JS wrappers that only a full collection frees; workerd turns off
# incremental marking and, open-source, sets no heap limit, and the JS heaps stay small, so a
# full collection hardly ever came and the native memory piled up: about 13 KB per call
# through the loader host, hundreds of MB within minutes (bench/workerd_memory.py). A full
# collection of a Worker's small heap costs about what the scavenge it replaces does.
V8_FLAGS = ("--gc-global",)


def capnp_string(value: str) -> str:
    """`value` as a capnp text literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def loader_host_config(*, port: int, code_dir: Path, log_sink_port: int | None, log_limits: dict | None) -> str:
    """The config of a workerd serving the loader host (`host.js`, beside the config) on
    127.0.0.1:`port`, reading code bundles from `code_dir`; with `log_sink_port`, the host
    posts the calls' records there, each within `log_limits`."""
    sink_service, sink_bindings = "", ""
    if log_sink_port is not None:
        sink_service = f"""
    (name = "logs", external = (address = "127.0.0.1:{log_sink_port}", http = ())),"""
        limits = json.dumps(log_limits or {})
        sink_bindings = f"""
    (name = "LOG_SINK", service = "logs"),
    (name = "LOG_LIMITS", text = {capnp_string(limits)}),"""
    return f"""using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  v8Flags = [{", ".join(capnp_string(flag) for flag in V8_FLAGS)}],
  services = [
    (name = "host", worker = .host),
    (name = "code", disk = (path = {capnp_string(str(code_dir.resolve()))}, writable = false)),{sink_service}
  ],
  sockets = [
    (name = "http", address = "127.0.0.1:{port}", http = (), service = "host"),
  ],
);

const host :Workerd.Worker = (
  modules = [(name = "host.js", esModule = embed "host.js")],
  compatibilityDate = "{COMPATIBILITY_DATE}",
  # enable_ctx_exports: the host hands each capability its own SigilTail entrypoint as its tail.
  compatibilityFlags = ["experimental", "nodejs_compat", "enable_ctx_exports"],
  bindings = [
    (name = "LOADER", workerLoader = (id = "capabilities")),
    (name = "CODE", service = "code"),
    (name = "SIGIL_SECRET", fromEnvironment = "SIGIL_INTERNAL_SECRET"),{sink_bindings}
  ],
);
"""
