"""The workerd config of a script with bindings the loader host cannot give.

Every script runs in a workerd of its own (`cfemulator.scripts`). Most run there as a
Dynamic Worker of the loader host, which can only be handed text values. A script that binds
a KV namespace, a Worker Loader or a dispatch namespace (Sigil's loader and dispatch
Workers, or a capability declaring KV) instead gets a config generated from its upload,
with real bindings:

- `worker_loader`: an object with Cloudflare's `get(id, getCode)` and `load(code)` in `env`,
  which runs each Dynamic Worker in a workerd process of its own (`cfemulator.dynamic`), so
  that one that spins is stopped at its own limits and no other notices, as on Cloudflare:
  the code `getCode` returns is handed to the emulator once per id, and each call of an
  entrypoint's `fetch` goes to that process through the emulator, which meters it;
- `kv_namespace`: workerd's own `kvNamespace` binding, whose requests come back to the
  emulator (`x-cfemulator-kv: {namespace id}`, and the script's process as the location KV
  reads and writes from, `x-cfemulator-kv-location`) and are served from its KV store;
- `dispatch_namespace`: open-source workerd has none (reference §4.3), so the emulator wraps
  the uploaded entry module with a small shim that puts an object with Cloudflare's
  `get(name, args, options)` in `env`; its Fetcher asks the emulator for the namespace
  script (`{name}.{namespace}.dispatch.localhost`) and throws "Worker not found" from
  `fetch`, as Cloudflare does, when there is none, "Worker exceeded CPU time limit."
  when the script ran past its limit, and "internal error; reference = …" when the emulator
  failed to run it (its own 500). The uploaded code itself runs unchanged.

The shim (for a dispatch namespace or a Worker Loader) re-exports the uploaded entry module's
named exports, so they stay the Worker's top-level exports, as on Cloudflare: `ctx.exports`
holds a binding for each (the loader host hands its SigilTail entrypoint to every Dynamic
Worker as its tail that way). A Dynamic Worker's tail events come back to its loader Worker's
process (DYNAMIC_TAIL_HEADER), where the shim hands them to the tails its code named.

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
# On the emulator's own failure (its 500) for a namespace script: the binding's Fetcher throws
# what workerd throws into JavaScript for a failure of the runtime itself, "internal error;
# reference = …" (the reference is the answer's ray id).
INTERNAL_ERROR_HEADER = "x-cfemulator-internal-error"
# A Worker Loader's Dynamic Workers (cfemulator.dynamic, cfemulator.dynamic_host): the binding
# hands a Dynamic Worker's code to the emulator (DYNAMIC_REGISTER_HEADER, naming the process of
# the loader Worker) and gets the emulator's key for it; each call names that key
# (DYNAMIC_CALL_HEADER) and the entrypoint (DYNAMIC_ENTRYPOINT_HEADER); tail events travel by
# key (DYNAMIC_TAIL_HEADER).
DYNAMIC_REGISTER_HEADER = "x-cfemulator-dynamic-register"
DYNAMIC_CALL_HEADER = "x-cfemulator-dynamic-call"
DYNAMIC_ENTRYPOINT_HEADER = "x-cfemulator-dynamic-entrypoint"
DYNAMIC_TAIL_HEADER = "x-cfemulator-dynamic-tail"
# Every header of the Dynamic Workers' traffic starts so: a caller's own never reach a script.
DYNAMIC_HEADER_PREFIX = "x-cfemulator-dynamic-"
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
# The name of the exception a Dynamic Worker threw, beside its message in EXCEPTION_HEADER.
EXCEPTION_NAME_HEADER = "x-cfemulator-exception-name"
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
# Worker Loader binding whose Dynamic Workers run in processes of their own (cfemulator.dynamic).
_SHIM = """\
import * as uploaded from {main};
// The uploaded module's named exports stay the Worker's top-level exports: its entrypoints and
// Durable Object classes, which ctx.exports and other Workers' bindings name.
export * from {main};

const NAMESPACES = {namespaces};
const LOADERS = {loaders};
// This process's name at the emulator: its Dynamic Workers' tail events are delivered here.
const OWNER = {owner};

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
          if (response.headers.has({internal_error_header})) {{
            throw new Error(`internal error; reference = ${{(response.headers.get("cf-ray") || "").split("-")[0]}}`);
          }}
          return response;
        }},
      }};
    }},
  }};
}}

// A method of `target`, bound to it. Not through `value.bind`: an RPC stub's method would take
// `bind` for one more remote method.
function bound(target, prop) {{
  const value = target[prop];
  return typeof value === "function" ? Function.prototype.bind.call(value, target) : value;
}}

// --- the Worker Loader binding ---------------------------------------------------------------
//
// Each Dynamic Worker runs in a workerd process of its own, as each has an isolate of its own
// on Cloudflare: its code is handed to the emulator once per id (DYNAMIC_REGISTER_HEADER), and
// each call of an entrypoint's fetch() goes to its process through the emulator, which meters
// it against the Dynamic Worker's own limits and stops that process alone.

// A stub from ctx.exports serves only the request that made it, and a Dynamic Worker's tails
// take the events of every later call too: so each stub made from ctx.exports is noted with how
// it was made, and made again in the request that delivers the events.
const madeFrom = new WeakMap();

function notingExports(exports) {{
  return new Proxy(exports, {{
    get(target, name) {{
      const entrypoint = target[name];
      if (typeof entrypoint !== "function" || typeof name !== "string") return entrypoint;
      const noted = new Proxy(entrypoint, {{
        apply(make, self, args) {{
          const stub = Reflect.apply(make, target, args);
          madeFrom.set(stub, {{ name, options: args[0] }});
          return stub;
        }},
        get: (make, prop) => bound(make, prop),
      }});
      madeFrom.set(noted, {{ name }});
      return noted;
    }},
  }});
}}

function notingContext(ctx) {{
  return new Proxy(ctx, {{
    get: (target, prop) => (prop === "exports" && target.exports ? notingExports(target.exports) : bound(target, prop)),
  }});
}}

// The tails each Dynamic Worker's code named, by the emulator's key for it.
const tailsByKey = new Map();
// The emulator's key of each Dynamic Worker by binding and id, once asked for: a promise, so
// that calls made while its code loads wait for it, and a getCode that failed stays failed, as
// workerd keeps a load that failed.
const keys = new Map();

class EmulatorUnanswered extends Error {{}}

function plainValue(value, path) {{
  if (value === null || value === undefined || ["string", "number", "boolean"].includes(typeof value)) return;
  if (Array.isArray(value)) {{
    value.forEach((item, index) => plainValue(item, `${{path}}[${{index}}]`));
    return;
  }}
  if (typeof value === "object" && Object.getPrototypeOf(value) === Object.prototype) {{
    for (const [name, item] of Object.entries(value)) plainValue(item, `${{path}}.${{name}}`);
    return;
  }}
  throw new TypeError(`the emulator hands a Dynamic Worker only plain values in its env: ${{path}} is not one`);
}}

function base64(data) {{
  const view = ArrayBuffer.isView(data)
    ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength)
    : new Uint8Array(data);
  let text = "";
  for (let at = 0; at < view.length; at += 0x8000) text += String.fromCharCode(...view.subarray(at, at + 0x8000));
  return btoa(text);
}}

// The WorkerCode as JSON, for the Dynamic Worker's process (cfemulator.dynamic_host decodes it).
// Throws a TypeError for what cannot cross to another process.
function encodedCode(code) {{
  if (!code || typeof code !== "object") throw new TypeError("getCode() must return a WorkerCode object");
  const modules = {{}};
  for (const [name, module] of Object.entries(code.modules || {{}})) {{
    const object = module && typeof module === "object" && !(module instanceof WebAssembly.Module);
    const kind = object ? Object.keys(module)[0] : null;
    const bytes = kind && (module[kind] instanceof ArrayBuffer || ArrayBuffer.isView(module[kind]));
    if (typeof module === "string") {{
      modules[name] = module;
    }} else if ((kind === "data" || kind === "wasm") && bytes) {{
      modules[name] = {{ kind, base64: base64(module[kind]) }};
    }} else if (kind) {{
      modules[name] = module;
    }} else {{
      throw new TypeError(
        `the emulator cannot hand the module ${{name}} to a Dynamic Worker's process: `
          + "give a WebAssembly module as {{ wasm: bytes }}",
      );
    }}
  }}
  plainValue(code.env, "env");
  if (code.globalOutbound) {{
    throw new TypeError("the emulator does not run a Dynamic Worker behind a globalOutbound Fetcher");
  }}
  if (code.streamingTails && code.streamingTails.length) {{
    throw new TypeError("the emulator does not give Dynamic Workers streamingTails");
  }}
  const encoded = {{ ...code, modules, tails: (code.tails || []).length }};
  delete encoded.streamingTails;
  delete encoded.globalOutbound;
  if (code.globalOutbound === null) encoded.globalOutbound = null;
  return encoded;
}}

async function handOver(emulator, binding, id, getCode) {{
  const code = await getCode();
  const body = JSON.stringify({{ binding, id, code: encodedCode(code) }});
  let answer;
  try {{
    answer = await emulator.fetch("http://cfemulator/", {{
      method: "POST", headers: {{ {register_header}: OWNER }}, body,
    }});
  }} catch (error) {{
    throw new EmulatorUnanswered(`the emulator did not take the Dynamic Worker's code: ${{error}}`);
  }}
  if (answer.status >= 500) throw new EmulatorUnanswered(await answer.text());
  if (!answer.ok) throw new Error(await answer.text());
  const {{ key }} = await answer.json();
  tailsByKey.set(key, [...(code.tails || [])]);
  return key;
}}

function keyOf(emulator, binding, id, getCode) {{
  if (id === null) return handOver(emulator, binding, id, getCode);  // never cached (reference §5.3)
  const cached = `${{binding}}\\n${{id}}`;
  let key = keys.get(cached);
  if (key === undefined) {{
    key = handOver(emulator, binding, id, getCode);
    keys.set(cached, key);
    // The emulator not answering is no failure of the code: a later call hands it over again.
    key.catch((error) => {{
      if (error instanceof EmulatorUnanswered && keys.get(cached) === key) keys.delete(cached);
    }});
  }}
  return key;
}}

function entrypoint(emulator, key, forget, name, options) {{
  const fetcher = {{
    async fetch(input, init) {{
      const request = new Request(input, init);
      const asked = {{
        name: name ?? null, props: options && options.props, limits: options && options.limits, url: request.url,
      }};
      const headers = new Headers(request.headers);
      headers.set({call_header}, await key());
      headers.set({entrypoint_header}, encodeURIComponent(JSON.stringify(asked)));
      const url = new URL(request.url);
      const answer = await emulator.fetch(`http://cfemulator${{url.pathname}}${{url.search}}`, {{
        method: request.method, headers, body: request.body, redirect: "manual",
      }});
      if (answer.headers.has({not_found_header})) {{
        forget();  // the emulator was reset since: the next call hands the code over again
        throw new Error("the emulator no longer holds this Dynamic Worker (it was reset)");
      }}
      const thrown = answer.headers.get({exception_header});
      if (thrown !== null) {{
        const error = new Error(decodeURIComponent(thrown));
        error.name = decodeURIComponent(answer.headers.get({exception_name_header}) || "Error");
        error.stack = await answer.text();
        throw error;
      }}
      const exceeded = answer.headers.get({exceeded_header});
      if (exceeded) {{
        await answer.arrayBuffer();
        throw new Error(exceeded === "memory" ? {memory_message} : {cpu_message});
      }}
      if (answer.headers.has({internal_error_header})) {{
        await answer.arrayBuffer();
        throw new Error(`internal error; reference = ${{(answer.headers.get("cf-ray") || "").split("-")[0]}}`);
      }}
      return answer;
    }},
  }};
  return new Proxy(fetcher, {{
    get(target, prop) {{
      if (prop in target || typeof prop !== "string" || prop === "then") return target[prop];
      throw new TypeError(`the emulator reaches a Dynamic Worker's entrypoint through fetch() only, not ${{prop}}()`);
    }},
  }});
}}

function workerLoader(emulator, binding) {{
  const stub = (id, getCode) => {{
    let key;  // asked for at the first call, as workerd loads the code once a request needs it
    const keyed = () => (key ??= keyOf(emulator, binding, id, getCode));
    const forget = () => {{
      const cached = `${{binding}}\\n${{id}}`;
      if (id !== null && keys.get(cached) === key) keys.delete(cached);
      key = undefined;
    }};
    return {{
      getEntrypoint: (name, options) => entrypoint(emulator, keyed, forget, name, options),
      getDurableObjectClass() {{
        throw new TypeError("the emulator does not give Dynamic Workers Durable Object classes");
      }},
    }};
  }};
  return {{
    get: (id, getCode) => stub(id === null || id === undefined ? null : String(id), getCode),
    load: (code) => stub(null, () => code),
  }};
}}

// A batch of a Dynamic Worker's tail events (DYNAMIC_TAIL_HEADER), for the tails its code named.
async function deliverTails(key, request, ctx) {{
  const events = await request.json();
  const failed = [];
  for (const tail of tailsByKey.get(key) || []) {{
    const made = madeFrom.get(tail);
    try {{
      let target = tail;
      if (made !== undefined) {{
        target = made.options === undefined ? ctx.exports[made.name] : ctx.exports[made.name](made.options);
      }}
      await target.tail(events);
    }} catch (error) {{
      failed.push(String((error && error.stack) || error));
    }}
  }}
  return new Response(failed.join("\\n") || null, {{ status: failed.length ? 500 : 204 }});
}}

function withBindings(env) {{
  const {{ {emulator}: emulator, ...rest }} = env;
  for (const [binding, namespace] of Object.entries(NAMESPACES)) rest[binding] = dispatchNamespace(emulator, namespace);
  for (const binding of LOADERS) rest[binding] = workerLoader(emulator, binding);
  return rest;
}}

const worker = uploaded.default;
export default {{
  fetch(request, env, ctx) {{
    if (LOADERS.length === 0) return worker.fetch(request, withBindings(env), ctx);
    const tailed = request.headers.get({tail_header});
    if (tailed !== null) return deliverTails(tailed, request, ctx);
    return worker.fetch(request, withBindings(env), notingContext(ctx));
  }},
}};
"""


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
    """Whether the script binds a Worker Loader, whose Dynamic Workers run in processes of their own."""
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
    #: the process's name at the emulator, to which its Dynamic Workers' tail events come back
    owner: str = ""
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
            owner=self.owner,
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
    owner: str = "",
    kv_location: str = "",
) -> tuple[str, dict[str, str]]:
    """The capnp config of one bound script listening on `port`, with a liveness probe on
    `probe_port` (its modules are written to `directory`), and the environment holding its
    text bindings. With `tail_key`, its tail events are posted to the emulator under that key;
    with `tail_entry`, each request to it is a batch of events for the script's `tail()`; with
    `hands_back`, an exception it throws goes back to its caller (a dispatch namespace's script);
    its KV bindings read and write from `kv_location`. `owner` is the process's name at the
    emulator, which its Worker Loader bindings hand over their Dynamic Workers' code with."""
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
    loaders: list[str] = []  # the Worker Loader bindings' names
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
            loaders.append(name)  # the shim's, whose Dynamic Workers run in processes of their own
        elif kind == "dispatch_namespace":
            namespaces[name] = binding["namespace"]
        # Other kinds (D1, R2, queues, services, ...) are not emulated: the script runs without them.

    main_module = upload.main_module
    flags = list(upload.compatibility_flags)
    if namespaces or loaders:
        services.append(f'(name = "cfemulator", external = (address = {_capnp(emulator_address)}, http = ()))')
        bindings.append(f'(name = {_capnp(EMULATOR_BINDING)}, service = "cfemulator")')
        shim = _SHIM.format(
            main=json.dumps("./" + main_module),
            namespaces=json.dumps(namespaces),
            loaders=json.dumps(loaders),
            owner=json.dumps(owner),
            register_header=json.dumps(DYNAMIC_REGISTER_HEADER),
            call_header=json.dumps(DYNAMIC_CALL_HEADER),
            entrypoint_header=json.dumps(DYNAMIC_ENTRYPOINT_HEADER),
            tail_header=json.dumps(DYNAMIC_TAIL_HEADER),
            exception_name_header=json.dumps(EXCEPTION_NAME_HEADER),
            limits_header=json.dumps(LIMITS_HEADER),
            original_host_header=json.dumps(ORIGINAL_HOST_HEADER),
            not_found_header=json.dumps(NOT_FOUND_HEADER),
            exception_header=json.dumps(EXCEPTION_HEADER),
            exceeded_header=json.dumps(EXCEEDED_HEADER),
            internal_error_header=json.dumps(INTERNAL_ERROR_HEADER),
            cpu_message=json.dumps(CPU_EXCEEDED_MESSAGE),
            memory_message=json.dumps(MEMORY_EXCEEDED_MESSAGE),
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
