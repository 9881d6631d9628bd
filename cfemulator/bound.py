"""The workerd config of a script with bindings the loader host cannot give.

Every script runs in a workerd of its own (`cfemulator.scripts`). Most run there as a
Dynamic Worker of the loader host, which can only be handed text values. A script that binds
a KV namespace, a Worker Loader or a dispatch namespace (Sigil's loader and dispatch
Workers, or a capability declaring KV) instead gets a config generated from its upload,
with real bindings:

- `worker_loader`: workerd's own `workerLoader` binding, wrapped so that the emulator meters
  each Dynamic Worker's CPU against the `limits` its entrypoint was given (the CPU meter:
  `cfemulator.cpumeter`, METER_HEADER);
- `kv_namespace`: workerd's own `kvNamespace` binding, whose requests come back to the
  emulator (`x-cfemulator-kv: {namespace id}`, and the script's process as the location KV
  reads and writes from, `x-cfemulator-kv-location`) and are served from its KV store;
- `dispatch_namespace`: open-source workerd has none (reference §4.3), so the emulator wraps
  the uploaded entry module with a small shim that puts an object with Cloudflare's
  `get(name, args, options)` in `env`; its Fetcher asks the emulator for the namespace
  script (`{name}.{namespace}.dispatch.localhost`) and throws "Worker not found" from
  `fetch`, as Cloudflare does, when there is none, and "Worker exceeded CPU time limit."
  when the script ran past its limit. The uploaded code itself runs unchanged.

The shim (for a dispatch namespace or a Worker Loader) re-exports the uploaded entry module's
named exports, so they stay the Worker's top-level exports, as on Cloudflare: `ctx.exports`
holds a binding for each (the loader host hands its SigilTail entrypoint to every Dynamic
Worker as its tail that way).

Every bound script's global `fetch()` leaves through a small Worker of the emulator's
(OUTBOUND_SOURCE), as a Worker's subrequests leave Cloudflare: a request for a workers.dev
host goes to the emulator's front door (what Cloudflare's front door would serve), marked
with whether the script has the `global_fetch_strictly_public` flag, without which
Cloudflare refuses a fetch of another Worker on the account's own workers.dev zone (error
1042); any other request goes out to the network (WORKER_OUTBOUND): public addresses, as on
Cloudflare, and this machine's loopback. Open-source workerd's default allows public
addresses only, and loopback stands in here for the owner's public origin, which Cloudflare
reaches (Sigil's Workers push call records there, and its edge hands it calls).

Text bindings reach the process through its environment, never its config file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capabilities.workerd.config import outbound_service
from capabilities.workerd.host import WorkerdHost
from cfemulator.limits import CPU_EXCEEDED_MESSAGE, MEMORY_EXCEEDED_MESSAGE
from cfemulator.uploads import COMMONJS_TYPES, ES_MODULE_TYPES, SOURCE_MAP_TYPE, ScriptUpload

logger = logging.getLogger(__name__)

# What a Worker's fetch() may reach: the public internet, and loopback as the owner's origin.
WORKER_OUTBOUND = ("public", "127.0.0.0/8", "::1/128")
OUTBOUND_SERVICE = "cfemulator-outbound"
NETWORK_SERVICE = "cfemulator-network"
# Binding types that make a script run from a workerd config of its own.
BOUND_BINDING_TYPES = frozenset({"kv_namespace", "worker_loader", "dispatch_namespace"})
KV_HEADER = "x-cfemulator-kv"
KV_LOCATION_HEADER = "x-cfemulator-kv-location"
LIMITS_HEADER = "x-cfemulator-limits"
# The host the dispatch Worker was called on: the user Worker sees the URL it would on Cloudflare.
ORIGINAL_HOST_HEADER = "x-cfemulator-original-host"
NOT_FOUND_HEADER = "x-cfemulator-worker-not-found"
# On the emulator's 1102 for a namespace script: the binding's Fetcher throws instead (§4.3).
EXCEEDED_HEADER = "x-cfemulator-exceeded-limits"
# The CPU meter around a Worker Loader's entrypoints. Open-source workerd does not enforce a
# Dynamic Worker's `limits` (reference §5.3), and it runs in its loader Worker's process; so the
# emulator gives each call to a script with a Worker Loader an id (CALL_HEADER, taken off
# before the script sees the request), and the binding's entrypoints tell the emulator when the
# call runs a Dynamic Worker and with what limit (METER_HEADER "begin" / "end", with
# METER_CPU_HEADER): the meter then stops the process once the call spent that limit.
CALL_HEADER = "x-cfemulator-call"
METER_HEADER = "x-cfemulator-meter"
METER_CPU_HEADER = "x-cfemulator-cpu-ms"
# How long after its start a Dynamic Worker that has not answered is taken to await (the timer
# fired, so it gave the event loop back): long enough for workerd to enter its handler.
YIELD_MS = 5
LOADER_BINDING_PREFIX = "__CFEMULATOR_LOADER_"
SHIM_MODULE = "__cfemulator_entry.js"
EMULATOR_BINDING = "__CFEMULATOR"
DISPATCH_HOST_SUFFIX = "dispatch.localhost"
# Tail Workers (a script's `tail_consumers`; for a dispatch namespace's scripts, those of the
# Worker that binds the namespace). workerd produces the tail events itself: a tailed script's
# config names a small Worker of the emulator's as its `tails`, which posts the events (its
# process key in TAIL_HEADER) to the emulator, which hands them to each consumer's `tail()`
# (cfemulator.tails). A consumer runs in a process of its own for that, behind _TAIL_ENTRY.
TAIL_HEADER = "x-cfemulator-tail"
TAIL_FORWARDER = "cfemulator-tail"
_TAIL_FORWARD = """export default {{
  async tail(events, env) {{
    await env.EMULATOR.fetch("http://cfemulator/", {{
      method: "POST", headers: {{ {header}: {key} }}, body: JSON.stringify(events),
    }});
  }},
}};
"""
# A dispatch namespace's script, run in a process of its own (its tail): Cloudflare hands the
# exception it throws to the dispatch Worker that called it, where `fetch()` throws it again.
# Over HTTP the emulator carries it back in EXCEPTION_HEADER (the binding's Fetcher rethrows
# it), and leaves it in the trace under EXCEPTION_MARK, which the tail relay turns back into
# the event's outcome and exception, as Cloudflare's trace shows them (cfemulator.tails).
EXCEPTION_HEADER = "x-cfemulator-exception"
EXCEPTION_MARK = "[cfemulator:exception]"
_HANDS_BACK = """import * as uploaded from {main};
export * from {main};
const worker = uploaded.default;
export default {{
  async fetch(request, env, ctx) {{
    try {{
      return await worker.fetch(request, env, ctx);
    }} catch (error) {{
      const message = String((error && error.message) || error);
      const name = String((error && error.name) || "Error");
      console.error({mark}, JSON.stringify({{ name, message, stack: String((error && error.stack) || "") }}));
      return new Response(String((error && error.stack) || error), {{
        status: 500, headers: {{ {header}: encodeURIComponent(message) }},
      }});
    }}
  }},
}};
"""
_TAIL_ENTRY = """import * as uploaded from {main};
export * from {main};
const worker = uploaded.default;
export default {{
  async fetch(request, env, ctx) {{
    const events = await request.json();
    if (worker && typeof worker.tail === "function") await worker.tail(events, env, ctx);
    return new Response(null, {{ status: 204 }});
  }},
}};
"""

# The dispatch namespace binding, as Cloudflare's runtime shapes it (reference §4.3), and the
# Worker Loader binding with the CPU meter around its entrypoints (see METER_HEADER).
_SHIM = """\
import * as uploaded from {main};
// The uploaded module's named exports stay the Worker's top-level exports: its entrypoints and
// Durable Object classes, which ctx.exports and other Workers' bindings name.
export * from {main};
{calls}

const NAMESPACES = {namespaces};
const LOADERS = {loaders};

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
          const thrown = response.headers.get({exception_header});
          if (thrown !== null) {{
            const error = new Error(decodeURIComponent(thrown));
            error.stack = await response.text();
            throw error;
          }}
          const exceeded = response.headers.get({exceeded_header});
          if (exceeded) throw new Error(exceeded === "memory" ? {memory_message} : {cpu_message});
          return response;
        }},
      }};
    }},
  }};
}}

// Tell the emulator that the call `call` now runs a Dynamic Worker limited to `cpuMs` ("begin"),
// that the Worker gave the event loop back ("yield"), or that it no longer runs ("end"): it stops
// the call's process once that limit is spent. A begin is answered once no other Dynamic Worker
// of the process holds the event loop, so the emulator knows which one spins.
// Returns true for the replay of a call whose Dynamic Worker the emulator stopped (a 429):
// that Worker is to throw Cloudflare's error at once.
async function meter(emulator, call, phase, cpuMs) {{
  const answer = await emulator.fetch("http://cfemulator/", {{
    method: "POST",
    headers: {{ {meter_header}: phase, {call_header}: call, {meter_cpu_header}: String(cpuMs || 0) }},
  }});
  return answer.status === 429;
}}

function bound(target, prop) {{
  const value = target[prop];
  return typeof value === "function" ? value.bind(target) : value;
}}

function meteredEntrypoint(entrypoint, emulator, cpuMs, loaded) {{
  return new Proxy(entrypoint, {{
    get(target, prop) {{
      if (prop !== "fetch") return bound(target, prop);
      return async (input, init) => {{
        const call = calls.getStore();
        const limit = cpuMs();
        if (!call || !limit) return target.fetch(input, init);
        // Its code is loaded first, so that what holds the event loop from the begin on is the
        // Worker's handler, not a read of its code (and a load this call left unfinished, when
        // it throws at once, would fail the next).
        await loaded();
        if (await meter(emulator, call, "begin", limit)) throw new Error({cpu_message});
        try {{
          const answer = target.fetch(input, init);
          // The Worker gave the event loop back once it answered, or once a timer could fire
          // (none can while it runs without awaiting).
          let settled = false;
          let timer;
          await new Promise((resolve) => {{
            answer.then(() => {{ settled = true; resolve(); }}, () => {{ settled = true; resolve(); }});
            timer = setTimeout(resolve, {yield_ms});
          }});
          clearTimeout(timer);
          if (!settled) await meter(emulator, call, "yield", 0);
          return await answer;
        }} finally {{
          await meter(emulator, call, "end", 0);
        }}
      }};
    }},
  }});
}}

function workerLoader(loader, emulator) {{
  const codeLimits = new Map();  // id -> WorkerCode.limits.cpuMs, once its code was loaded
  const stub = (worker, id) => new Proxy(worker, {{
    get(target, prop) {{
      if (prop !== "getEntrypoint") return bound(target, prop);
      return (name, options) => {{
        const asked = options && options.limits && options.limits.cpuMs;
        // The lower of the two limits wins (reference §5.3); 0: none set.
        const cpuMs = () => {{
          const given = [asked, codeLimits.get(id)].filter((ms) => ms > 0);
          return given.length ? Math.min(...given) : 0;
        }};
        // Asking for an entrypoint no Worker has loads the code without calling its handlers.
        const loaded = () => target.getEntrypoint("CfemulatorLoaded").fetch("http://loaded/").catch(() => null);
        return meteredEntrypoint(target.getEntrypoint(name, options), emulator, cpuMs, loaded);
      }};
    }},
  }});
  const noting = (id, getCode) => async () => {{
    const code = await getCode();
    codeLimits.set(id, code && code.limits && code.limits.cpuMs);
    return code;
  }};
  return {{
    get: (id, getCode) => stub(loader.get(id, noting(id, getCode)), id),
    load: (code) => {{
      const id = Symbol("load");
      codeLimits.set(id, code && code.limits && code.limits.cpuMs);
      return stub(loader.load(code), id);
    }},
  }};
}}

function withBindings(env) {{
  const {{ {emulator}: emulator, ...rest }} = env;
  for (const [binding, namespace] of Object.entries(NAMESPACES)) rest[binding] = dispatchNamespace(emulator, namespace);
  for (const [binding, real] of Object.entries(LOADERS)) {{
    rest[binding] = workerLoader(env[real], emulator);
    delete rest[real];
  }}
  return rest;
}}

const worker = uploaded.default;
export default {{
  fetch(request, env, ctx) {{
    const call = request.headers.get({call_header});
    if (call !== null) {{
      const headers = new Headers(request.headers);
      headers.delete({call_header});
      request = new Request(request, {{ headers }});
    }}
    return calls.run(call, () => worker.fetch(request, withBindings(env), ctx));
  }},
}};
"""


# The emulator's id of the call a Worker with a Worker Loader serves, for the CPU meter (an
# AsyncLocalStorage needs the nodejs_als flag, so a script without a loader does without).
_CALLS = """import { AsyncLocalStorage } from "node:async_hooks";
const calls = new AsyncLocalStorage();"""
_NO_CALLS = "const calls = { run: (_, run) => run(), getStore: () => null };"

# A bound script's subrequests (its global fetch): workers.dev hosts to the emulator's front door,
# anything else to the network (see the module's docstring). SUBREQUEST_HEADER carries whether
# the script may fetch its own zone's Workers ("strict": global_fetch_strictly_public) or not
# ("private"); the emulator takes it off before a Worker sees the request.
SUBREQUEST_HEADER = "x-cfemulator-subrequest"
STRICTLY_PUBLIC_FLAG = "global_fetch_strictly_public"
OUTBOUND_SOURCE = """export default {
  fetch(request, env) {
    if (new URL(request.url).hostname.endsWith(".workers.dev")) return env.FRONT_DOOR.fetch(request);
    return fetch(request);
  },
};
"""

# Answers the supervisor's liveness probe: any answer shows the process's event loop turns.
_PROBE = "export default { fetch() { return new Response(null, { status: 204 }) } }"


def has_worker_loader(upload: ScriptUpload) -> bool:
    """Whether the script binds a Worker Loader, whose Dynamic Workers the emulator meters."""
    return any(binding.get("type") == "worker_loader" for binding in upload.bindings)


def needs_own_workerd(upload: ScriptUpload) -> bool:
    """Whether the script binds something only a workerd config of its own can give it."""
    return any(binding.get("type") in BOUND_BINDING_TYPES for binding in upload.bindings)


def _capnp(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid Cap'n Proto text literal


def _list(items: list[str]) -> str:
    return "[" + ",\n    ".join(items) + "]"


@dataclass
class BoundHost(WorkerdHost):
    """A bound script's workerd, for `capabilities.workerd.supervision`: the script listens on
    `script_port`, and `port` answers the supervisor's liveness probe from a Worker of the
    emulator's own, in the same process, so no probe ever runs the script's code."""

    upload: ScriptUpload | None = None
    sha: str = ""
    emulator_port: int = 0
    script_port: int = 0
    #: the process key its tail events are posted with; None: its events go nowhere
    tail_key: str | None = None
    #: whether the process serves only the deliveries of events to the script's `tail()`
    tail_entry: bool = False
    #: whether the script is a dispatch namespace's, whose exceptions go back to its caller
    hands_back: bool = False
    #: where its KV bindings read and write from (its process key): Workers KV's location
    kv_location: str = ""
    _environment: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config, self._environment = bound_config(
            self.state_dir,
            self.upload,
            port=self.script_port,
            probe_port=self.port,
            emulator_port=self.emulator_port,
            tail_key=self.tail_key,
            tail_entry=self.tail_entry,
            hands_back=self.hands_back,
            kv_location=self.kv_location,
        )
        self.config_path.write_text(config)
        return self.config_path

    def environment(self) -> dict[str, str]:
        return self._environment


def bound_config(
    directory: Path,
    upload: ScriptUpload,
    *,
    port: int,
    probe_port: int,
    emulator_port: int,
    tail_key: str | None = None,
    tail_entry: bool = False,
    hands_back: bool = False,
    kv_location: str = "",
) -> tuple[str, dict[str, str]]:
    """The capnp config of one bound script listening on `port`, with a liveness probe on
    `probe_port` (its modules are written to `directory`), and the environment holding its
    text bindings. With `tail_key`, its tail events are posted to the emulator under that key;
    with `tail_entry`, each request to it is a batch of events for the script's `tail()`; with
    `hands_back`, an exception it throws goes back to its caller (a dispatch namespace's script);
    its KV bindings read and write from `kv_location`."""
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
    services = [
        '(name = "main", worker = .main)',
        '(name = "probe", worker = .probe)',
        outbound_service(NETWORK_SERVICE, WORKER_OUTBOUND),
    ]
    bindings: list[str] = []
    environment: dict[str, str] = {}
    namespaces: dict[str, str] = {}
    loaders: dict[str, str] = {}  # binding name -> the real binding's name, behind the meter
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
            headers = (
                f"(name = {_capnp(KV_HEADER)}, value = {_capnp(binding['namespace_id'])}), "
                f"(name = {_capnp(KV_LOCATION_HEADER)}, value = {_capnp(kv_location)})"
            )
            services.append(
                f"(name = {_capnp(service)}, external = (address = {_capnp(emulator_address)}, "
                f"http = (injectRequestHeaders = [{headers}])))"
            )
            bindings.append(f"(name = {_capnp(name)}, kvNamespace = {_capnp(service)})")
        elif kind == "worker_loader":
            loaders[name] = LOADER_BINDING_PREFIX + name
            bindings.append(f"(name = {_capnp(loaders[name])}, workerLoader = ())")
        elif kind == "dispatch_namespace":
            namespaces[name] = binding["namespace"]
        # Other kinds (D1, R2, queues, services, ...) are not emulated: the script runs without them.

    main_module = upload.main_module
    flags = list(upload.compatibility_flags)
    if loaders and "experimental" not in flags:
        # workerd runs a Worker Loader only under the experimental flag (reference §5.2).
        flags.append("experimental")
    if namespaces or loaders:
        # The shim keeps the call's id in an AsyncLocalStorage.
        if loaders and not {"nodejs_als", "nodejs_compat"} & set(flags):
            flags.append("nodejs_als")
        services.append(f'(name = "cfemulator", external = (address = {_capnp(emulator_address)}, http = ()))')
        bindings.append(f'(name = {_capnp(EMULATOR_BINDING)}, service = "cfemulator")')
        shim = _SHIM.format(
            main=json.dumps("./" + main_module),
            namespaces=json.dumps(namespaces),
            loaders=json.dumps(loaders),
            calls=_CALLS if loaders else _NO_CALLS,
            meter_header=json.dumps(METER_HEADER),
            call_header=json.dumps(CALL_HEADER),
            meter_cpu_header=json.dumps(METER_CPU_HEADER),
            limits_header=json.dumps(LIMITS_HEADER),
            original_host_header=json.dumps(ORIGINAL_HOST_HEADER),
            not_found_header=json.dumps(NOT_FOUND_HEADER),
            exception_header=json.dumps(EXCEPTION_HEADER),
            exceeded_header=json.dumps(EXCEEDED_HEADER),
            cpu_message=json.dumps(CPU_EXCEEDED_MESSAGE),
            memory_message=json.dumps(MEMORY_EXCEEDED_MESSAGE),
            yield_ms=YIELD_MS,
            suffix=DISPATCH_HOST_SUFFIX,
            emulator=EMULATOR_BINDING,
        )
        (directory / "shim.js").write_text(shim)
        modules.insert(0, f'(name = {_capnp(SHIM_MODULE)}, esModule = embed "shim.js")')
        main_module = SHIM_MODULE
    elif hands_back:
        wrapper = _HANDS_BACK.format(
            main=json.dumps("./" + main_module), header=json.dumps(EXCEPTION_HEADER), mark=json.dumps(EXCEPTION_MARK)
        )
        (directory / "hands-back.js").write_text(wrapper)
        modules.insert(0, f'(name = {_capnp(SHIM_MODULE)}, esModule = embed "hands-back.js")')
        main_module = SHIM_MODULE
    elif tail_entry:
        (directory / "tail-entry.js").write_text(_TAIL_ENTRY.format(main=json.dumps("./" + main_module)))
        modules.insert(0, f'(name = {_capnp(SHIM_MODULE)}, esModule = embed "tail-entry.js")')
        main_module = SHIM_MODULE
    else:
        index = next(i for i, m in enumerate(modules) if m.startswith(f"(name = {_capnp(main_module)},"))
        modules.insert(0, modules.pop(index))  # workerd's entry point is the first module
    strict = "strict" if STRICTLY_PUBLIC_FLAG in upload.compatibility_flags else "private"
    (directory / "outbound.js").write_text(OUTBOUND_SOURCE)
    front_door = f"(name = {_capnp(SUBREQUEST_HEADER)}, value = {_capnp(strict)})"
    services += [
        f"(name = {_capnp(OUTBOUND_SERVICE)}, worker = .outbound)",
        f'(name = "cfemulator-front-door", external = (address = {_capnp(emulator_address)}, '
        f"http = (injectRequestHeaders = [{front_door}])))",
    ]
    tails, forwarder = "", ""
    if tail_key is not None:
        (directory / "tail-forward.js").write_text(
            _TAIL_FORWARD.format(header=json.dumps(TAIL_HEADER), key=json.dumps(tail_key))
        )
        services.append(f"(name = {_capnp(TAIL_FORWARDER)}, worker = .tailForward)")
        if not (namespaces or loaders):
            services.append(f'(name = "cfemulator", external = (address = {_capnp(emulator_address)}, http = ()))')
        tails = f"\n  tails = [{_capnp(TAIL_FORWARDER)}],"
        forwarder = """
const tailForward :Workerd.Worker = (
  modules = [(name = "tail-forward.js", esModule = embed "tail-forward.js")],
  compatibilityDate = "2025-01-01",
  bindings = [(name = "EMULATOR", service = "cfemulator")],
);
"""

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
  bindings = {_list(bindings)},{tails}
  globalOutbound = {_capnp(OUTBOUND_SERVICE)},
);

const outbound :Workerd.Worker = (
  modules = [(name = "outbound.js", esModule = embed "outbound.js")],
  compatibilityDate = "2025-01-01",
  bindings = [(name = "FRONT_DOOR", service = "cfemulator-front-door")],
  globalOutbound = {_capnp(NETWORK_SERVICE)},
);
{forwarder}"""
    return config, environment


def kv_list_body(items: list[dict[str, Any]], *, cursor: str) -> bytes:
    """The body workerd's KV binding expects for `list()`."""
    return json.dumps({"keys": items, "list_complete": not cursor, **({"cursor": cursor} if cursor else {})}).encode()
