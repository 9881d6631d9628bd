"""The capnp config of a workerd serving the loader host (`capabilities/runtimes/host/host.js`)."""

from __future__ import annotations

import json
from pathlib import Path

HOST_DIR = Path(__file__).resolve().parent.parent / "runtimes" / "host"
# The loader host's modules: its entry, and the report channel its tail sends call records by.
HOST_MODULES = ("host.js", "channel.js")
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


def outbound_service(name: str, allow: tuple[str, ...]) -> str:
    """A network service reaching the addresses `allow` names (workerd's `Network.allow`:
    "public", "local", CIDR blocks), for a Worker's `globalOutbound`."""
    return f"(name = {capnp_string(name)}, network = (allow = [{', '.join(capnp_string(a) for a in allow)}]))"


def loader_host_config(
    *,
    port: int,
    code_dir: Path,
    log_sink_port: int | None,
    log_limits: dict | None,
    outbound_allow: tuple[str, ...] | None = None,
) -> str:
    """The config of a workerd serving the loader host (HOST_MODULES, beside the config) on
    127.0.0.1:`port`, reading code bundles from `code_dir`; with `log_sink_port`, the host
    posts the calls' records there, each within `log_limits`. Its `fetch()` reaches the
    public internet only (workerd's default), or with `outbound_allow` the addresses it names
    (the Cloudflare emulator lets its Workers reach this machine's loopback)."""
    extra_services, sink_bindings, outbound = "", "", ""
    if outbound_allow is not None:
        extra_services = f"\n    {outbound_service('outbound', outbound_allow)},"
        outbound = '\n  globalOutbound = "outbound",'
    if log_sink_port is not None:
        extra_services += f"""
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
    (name = "code", disk = (path = {capnp_string(str(code_dir.resolve()))}, writable = false)),{extra_services}
  ],
  sockets = [
    (name = "http", address = "127.0.0.1:{port}", http = (), service = "host"),
  ],
);

const host :Workerd.Worker = (
  modules = [{", ".join(f'(name = "{name}", esModule = embed "{name}")' for name in HOST_MODULES)}],
  compatibilityDate = "{COMPATIBILITY_DATE}",
  # enable_ctx_exports: the host hands each capability its own SigilTail entrypoint as its tail.
  compatibilityFlags = ["experimental", "nodejs_compat", "enable_ctx_exports"],
  bindings = [
    (name = "LOADER", workerLoader = (id = "capabilities")),
    (name = "CODE", service = "code"),
    (name = "SIGIL_SECRET", fromEnvironment = "SIGIL_INTERNAL_SECRET"),{sink_bindings}
  ],{outbound}
);
"""
