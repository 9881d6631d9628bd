"""The workerd config of a script with bindings the loader host cannot give.

Every script runs in a workerd of its own (`cfemulator.scripts`). Most run there as a
Dynamic Worker of the loader host, which can only be handed text values. A script that binds
a KV namespace, a Worker Loader or a dispatch namespace (Sigil's loader and dispatch
Workers, or a capability declaring KV) instead gets a config generated from its upload,
with real bindings:

- `worker_loader`: workerd's own `workerLoader` binding;
- `kv_namespace`: workerd's own `kvNamespace` binding, whose requests come back to the
  emulator (`x-cfemulator-kv: {namespace id}`) and are served from its KV store;
- `dispatch_namespace`: open-source workerd has none (reference §4.3), so the emulator wraps
  the uploaded entry module with a small shim that puts an object with Cloudflare's
  `get(name, args, options)` in `env`; its Fetcher asks the emulator for the namespace
  script (`{name}.{namespace}.dispatch.localhost`) and throws "Worker not found" from
  `fetch`, as Cloudflare does, when there is none, and "Worker exceeded CPU time limit."
  when the script ran past its limit. The uploaded code itself runs unchanged.

Text bindings reach the process through its environment, never its config file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capabilities.workerd import WorkerdHost
from cfemulator.limits import CPU_EXCEEDED_MESSAGE, MEMORY_EXCEEDED_MESSAGE
from cfemulator.uploads import COMMONJS_TYPES, ES_MODULE_TYPES, SOURCE_MAP_TYPE, ScriptUpload

logger = logging.getLogger(__name__)

# Binding types that make a script run from a workerd config of its own.
BOUND_BINDING_TYPES = frozenset({"kv_namespace", "worker_loader", "dispatch_namespace"})
KV_HEADER = "x-cfemulator-kv"
LIMITS_HEADER = "x-cfemulator-limits"
# The host the dispatch Worker was called on: the user Worker sees the URL it would on Cloudflare.
ORIGINAL_HOST_HEADER = "x-cfemulator-original-host"
NOT_FOUND_HEADER = "x-cfemulator-worker-not-found"
# On the emulator's 1102 for a namespace script: the binding's Fetcher throws instead (§4.3).
EXCEEDED_HEADER = "x-cfemulator-exceeded-limits"
SHIM_MODULE = "__cfemulator_entry.js"
EMULATOR_BINDING = "__CFEMULATOR"
DISPATCH_HOST_SUFFIX = "dispatch.localhost"

# The dispatch namespace binding, as Cloudflare's runtime shapes it (reference §4.3).
_SHIM = """\
import * as uploaded from {main};

const NAMESPACES = {namespaces};

function dispatchNamespace(emulator, namespace) {{
  return {{
    get(name, args = {{}}, options = {{}}) {{
      if (typeof name !== "string" || name === "") throw new TypeError("a Worker name is required");
      const limits = (options && options.limits) || {{}};
      return {{
        async fetch(input, init) {{
          const request = new Request(input, init);
          const url = new URL(request.url);
          const headers = new Headers(request.headers);
          headers.set({limits_header}, JSON.stringify(limits));
          headers.set({original_host_header}, url.host);
          const target = `http://${{name}}.${{namespace}}.{suffix}${{url.pathname}}${{url.search}}`;
          const response = await emulator.fetch(target, {{
            method: request.method, headers, body: request.body, redirect: "manual",
          }});
          if (response.headers.has({not_found_header})) throw new Error("Worker not found.");
          const exceeded = response.headers.get({exceeded_header});
          if (exceeded) throw new Error(exceeded === "memory" ? {memory_message} : {cpu_message});
          return response;
        }},
      }};
    }},
  }};
}}

function withNamespaces(env) {{
  const {{ {emulator}: emulator, ...rest }} = env;
  for (const [binding, namespace] of Object.entries(NAMESPACES)) rest[binding] = dispatchNamespace(emulator, namespace);
  return rest;
}}

const worker = uploaded.default;
export default {{
  fetch(request, env, ctx) {{
    return worker.fetch(request, withNamespaces(env), ctx);
  }},
}};
"""


# Answers the supervisor's liveness probe: any answer shows the process's event loop turns.
_PROBE = "export default { fetch() { return new Response(null, { status: 204 }) } }"


def needs_own_workerd(upload: ScriptUpload) -> bool:
    """Whether the script binds something only a workerd config of its own can give it."""
    return any(binding.get("type") in BOUND_BINDING_TYPES for binding in upload.bindings)


def _capnp(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid Cap'n Proto text literal


def _list(items: list[str]) -> str:
    return "[" + ",\n    ".join(items) + "]"


@dataclass
class BoundHost(WorkerdHost):
    """A bound script's workerd, for `capabilities.supervision`: the script listens on
    `script_port`, and `port` answers the supervisor's liveness probe from a Worker of the
    emulator's own, in the same process, so no probe ever runs the script's code."""

    upload: ScriptUpload | None = None
    sha: str = ""
    emulator_port: int = 0
    script_port: int = 0
    _environment: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config, self._environment = bound_config(
            self.state_dir,
            self.upload,
            port=self.script_port,
            probe_port=self.port,
            emulator_port=self.emulator_port,
        )
        self.config_path.write_text(config)
        return self.config_path

    def environment(self) -> dict[str, str]:
        return self._environment


def bound_config(
    directory: Path, upload: ScriptUpload, *, port: int, probe_port: int, emulator_port: int
) -> tuple[str, dict[str, str]]:
    """The capnp config of one bound script listening on `port`, with a liveness probe on
    `probe_port` (its modules are written to `directory`), and the environment holding its
    text bindings."""
    modules = []
    for index, (name, kind) in enumerate(upload.module_types.items()):
        if kind == SOURCE_MAP_TYPE:
            continue
        source = upload.loader_modules[name]
        text = source if isinstance(source, str) else next(iter(source.values()))
        file_name = f"m{index}"
        (directory / file_name).write_text(text)
        shape = "esModule" if kind in ES_MODULE_TYPES else "commonJsModule" if kind in COMMONJS_TYPES else "text"
        modules.append(f"(name = {_capnp(name)}, {shape} = embed {_capnp(file_name)})")

    emulator_address = f"127.0.0.1:{emulator_port}"
    services = ['(name = "main", worker = .main)', '(name = "probe", worker = .probe)']
    bindings: list[str] = []
    environment: dict[str, str] = {}
    namespaces: dict[str, str] = {}
    for index, binding in enumerate(upload.bindings):
        name, kind = binding["name"], binding["type"]
        if kind in ("plain_text", "secret_text"):
            variable = f"CFEMULATOR_BINDING_{index}"
            environment[variable] = binding["text"]
            bindings.append(f"(name = {_capnp(name)}, fromEnvironment = {_capnp(variable)})")
        elif kind == "json":
            bindings.append(f"(name = {_capnp(name)}, json = {_capnp(json.dumps(binding.get('json')))})")
        elif kind == "kv_namespace":
            service = f"kv-{index}"
            header = f"(name = {_capnp(KV_HEADER)}, value = {_capnp(binding['namespace_id'])})"
            services.append(
                f"(name = {_capnp(service)}, external = (address = {_capnp(emulator_address)}, "
                f"http = (injectRequestHeaders = [{header}])))"
            )
            bindings.append(f"(name = {_capnp(name)}, kvNamespace = {_capnp(service)})")
        elif kind == "worker_loader":
            bindings.append(f"(name = {_capnp(name)}, workerLoader = ())")
        elif kind == "dispatch_namespace":
            namespaces[name] = binding["namespace"]
        # Other kinds (D1, R2, queues, services, ...) are not emulated: the script runs without them.

    main_module = upload.main_module
    flags = list(upload.compatibility_flags)
    if any(b["type"] == "worker_loader" for b in upload.bindings) and "experimental" not in flags:
        # workerd runs a Worker Loader only under the experimental flag (reference §5.2).
        flags.append("experimental")
    if namespaces:
        services.append(f'(name = "cfemulator", external = (address = {_capnp(emulator_address)}, http = ()))')
        bindings.append(f'(name = {_capnp(EMULATOR_BINDING)}, service = "cfemulator")')
        shim = _SHIM.format(
            main=json.dumps("./" + main_module),
            namespaces=json.dumps(namespaces),
            limits_header=json.dumps(LIMITS_HEADER),
            original_host_header=json.dumps(ORIGINAL_HOST_HEADER),
            not_found_header=json.dumps(NOT_FOUND_HEADER),
            exceeded_header=json.dumps(EXCEEDED_HEADER),
            cpu_message=json.dumps(CPU_EXCEEDED_MESSAGE),
            memory_message=json.dumps(MEMORY_EXCEEDED_MESSAGE),
            suffix=DISPATCH_HOST_SUFFIX,
            emulator=EMULATOR_BINDING,
        )
        (directory / "shim.js").write_text(shim)
        modules.insert(0, f'(name = {_capnp(SHIM_MODULE)}, esModule = embed "shim.js")')
        main_module = SHIM_MODULE
    else:
        index = next(i for i, m in enumerate(modules) if m.startswith(f"(name = {_capnp(main_module)},"))
        modules.insert(0, modules.pop(index))  # workerd's entry point is the first module

    config = f"""using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  services = {_list(services)},
  sockets = [
    (name = "http", address = "127.0.0.1:{port}", http = (), service = "main"),
    (name = "probe", address = "127.0.0.1:{probe_port}", http = (), service = "probe"),
  ],
);

const probe :Workerd.Worker = (
  modules = [(name = "probe.js", esModule = {_capnp(_PROBE)})],
  compatibilityDate = "2025-01-01",
);

const main :Workerd.Worker = (
  modules = {_list(modules)},
  compatibilityDate = {_capnp(upload.compatibility_date)},
  compatibilityFlags = {_list([_capnp(flag) for flag in flags])},
  bindings = {_list(bindings)},
);
"""
    return config, environment


def kv_list_body(items: list[dict[str, Any]], *, cursor: str) -> bytes:
    """The body workerd's KV binding expects for `list()`."""
    return json.dumps({"keys": items, "list_complete": not cursor, **({"cursor": cursor} if cursor else {})}).encode()
