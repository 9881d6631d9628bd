"""The workerd process a Dynamic Worker runs in, apart from its loader Worker's.

On Cloudflare each Dynamic Worker runs in an isolate of its own: one that spins is stopped at
its CPU limit and no other notices. One workerd runs all its isolates on one event loop, so
the emulator runs each Dynamic Worker (`cfemulator.dynamic`) in a process of its own: a small
Worker of the emulator's, the runner, with a real Worker Loader binding. Each call names the
Dynamic Worker by the emulator's key for it (DYNAMIC_CALL_HEADER); the runner loads it through
its binding under that key, its code read from the emulator's directory of them (`{key}.json`,
a disk service) only when workerd has no warm isolate for it, and calls the entrypoint the loader Worker asked for
(DYNAMIC_ENTRYPOINT_HEADER: its name, props and limits, and the request's own URL). What
workerd's loader does (start the code, refuse code that does not start, `abortIsolate()`,
the entrypoints' names) is therefore workerd's own.

What the Dynamic Worker throws goes back to its loader Worker as the dispatch namespace's
scripts' exceptions do (EXCEPTION_HEADER, the stack as the body), and is thrown again there.
When its loader Worker named tails, the runner gives the Dynamic Worker one of its own, which
posts each batch of events to the emulator (DYNAMIC_TAIL_HEADER), which hands them to the loader
Worker's tails in its own process (`cfemulator.tails`).

The runner answers a request without a key (the supervisor's liveness probe) with a 204 and
runs nothing; one with WARM_UP_HEADER runs a Worker of the runner's own, which does nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from capabilities.workerd.config import V8_FLAGS
from capabilities.workerd.host import WorkerdHost
from cfemulator.bound import (
    DYNAMIC_CALL_HEADER,
    DYNAMIC_ENTRYPOINT_HEADER,
    DYNAMIC_TAIL_HEADER,
    EXCEPTION_HEADER,
    EXCEPTION_NAME_HEADER,
)

# The emulator's request that has a spare runner load and call a Worker of its own, so that
# the Dynamic Worker it is given next does not wait for the runner's own first run.
WARM_UP_HEADER = "x-cfemulator-warm-up"

_RUNNER = """import {{ WorkerEntrypoint }} from "cloudflare:workers";

const CALL = {call_header};
const ENTRYPOINT = {entrypoint_header};
const TAIL = {tail_header};
const WARM_UP = {warm_up_header};
const NOTHING = {{
  compatibilityDate: "2025-01-01",
  mainModule: "nothing.js",
  modules: {{ "nothing.js": "export default {{ fetch() {{ return new Response(null, {{ status: 204 }}) }} }}" }},
}};

// The Dynamic Worker's tail: each batch of its events goes to the emulator, which hands it to
// the tails its loader Worker named.
export class CfemulatorTail extends WorkerEntrypoint {{
  async tail(events) {{
    await this.env.EMULATOR.fetch("http://cfemulator/", {{
      method: "POST", headers: {{ [TAIL]: this.ctx.props.key }}, body: JSON.stringify(events),
    }});
  }}
}}

function bytes(base64) {{
  return Uint8Array.from(atob(base64), (c) => c.charCodeAt(0)).buffer;
}}

// The code file is sealed (AES-256-GCM, the nonce first) under the key the emulator gives this
// process in its environment: a Dynamic Worker's env may hold secret values, which no file keeps.
let codeKey = null;
async function opened(file, env) {{
  codeKey ??= await crypto.subtle.importKey("raw", bytes(env.CODE_KEY), "AES-GCM", false, ["decrypt"]);
  const sealed = new Uint8Array(bytes(file.sealed));
  const aes = {{ name: "AES-GCM", iv: sealed.subarray(0, 12) }};
  return JSON.parse(new TextDecoder().decode(await crypto.subtle.decrypt(aes, codeKey, sealed.subarray(12))));
}}

// The WorkerCode as the loader Worker's binding encoded it (cfemulator.bound, encodedCode).
function decoded(code, key, ctx) {{
  const modules = {{}};
  for (const [name, module] of Object.entries(code.modules)) {{
    if (module && typeof module === "object" && "base64" in module) {{
      modules[name] = {{ [module.kind]: bytes(module.base64) }};
    }} else {{
      modules[name] = module;
    }}
  }}
  const worker = {{ ...code, modules }};
  delete worker.tails;
  delete worker.globalOutbound;
  if (code.globalOutbound === null) worker.globalOutbound = null;
  if (code.tails > 0) worker.tails = [ctx.exports.CfemulatorTail({{ props: {{ key }} }})];
  return worker;
}}

function thrown(error) {{
  const message = String((error && error.message) || error);
  const name = String((error && error.name) || "Error");
  return new Response(String((error && error.stack) || error), {{
    status: 500,
    headers: {{ {exception_header}: encodeURIComponent(message), {exception_name_header}: encodeURIComponent(name) }},
  }});
}}

export default {{
  async fetch(request, env, ctx) {{
    if (request.headers.has(WARM_UP)) return env.LOADER.get(WARM_UP, () => NOTHING).getEntrypoint().fetch(request);
    const key = request.headers.get(CALL);
    if (key === null) return new Response(null, {{ status: 204 }});
    const asked = JSON.parse(decodeURIComponent(request.headers.get(ENTRYPOINT) || "%7B%7D"));
    const worker = env.LOADER.get(key, async () => {{
      const answer = await env.CODE.fetch(`http://code/${{key}}.json`);
      if (!answer.ok) throw new Error(`the emulator holds no code for the Dynamic Worker ${{key}}`);
      return decoded(await opened(await answer.json(), env), key, ctx);
    }});
    const headers = new Headers(request.headers);
    headers.delete(CALL);
    headers.delete(ENTRYPOINT);
    const forwarded = new Request(asked.url || request.url, {{
      method: request.method, headers, body: request.body, redirect: "manual",
    }});
    const options = {{}};
    if (asked.props !== undefined) options.props = asked.props;
    if (asked.limits) options.limits = asked.limits;
    try {{
      return await worker.getEntrypoint(asked.name ?? null, options).fetch(forwarded);
    }} catch (error) {{
      return thrown(error);
    }}
  }},
}};
"""


def runner_source() -> str:
    """The runner Worker's module."""
    return _RUNNER.format(
        call_header=json.dumps(DYNAMIC_CALL_HEADER),
        entrypoint_header=json.dumps(DYNAMIC_ENTRYPOINT_HEADER),
        tail_header=json.dumps(DYNAMIC_TAIL_HEADER),
        warm_up_header=json.dumps(WARM_UP_HEADER),
        exception_header=json.dumps(EXCEPTION_HEADER),
        exception_name_header=json.dumps(EXCEPTION_NAME_HEADER),
    )


def _capnp(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid Cap'n Proto text literal


def runner_config(*, port: int, emulator_port: int, code_dir: Path) -> str:
    """The capnp config of a runner listening on 127.0.0.1:`port` (its module, runner.js,
    beside the config), whose Worker Loader loads the code kept in `code_dir`, and whose tail
    posts to the emulator on `emulator_port`."""
    return f"""using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  # Every V8 collection a full one (capabilities.workerd.config): a runner serves every call of
  # its Dynamic Worker, and native memory would pile up behind the wrappers otherwise.
  v8Flags = [{", ".join(_capnp(flag) for flag in V8_FLAGS)}],
  services = [
    (name = "runner", worker = .runner),
    (name = "cfemulator", external = (address = "127.0.0.1:{emulator_port}", http = ())),
    (name = "code", disk = (path = {_capnp(str(code_dir.resolve()))}, writable = false)),
  ],
  sockets = [(name = "http", address = "127.0.0.1:{port}", http = (), service = "runner")],
);

const runner :Workerd.Worker = (
  modules = [(name = "runner.js", esModule = embed "runner.js")],
  compatibilityDate = "2025-01-01",
  # workerd runs a Worker Loader only under the experimental flag (reference §5.2);
  # enable_ctx_exports: the runner hands each Dynamic Worker its CfemulatorTail entrypoint.
  compatibilityFlags = ["experimental", "enable_ctx_exports"],
  bindings = [
    (name = "LOADER", workerLoader = ()),
    (name = "EMULATOR", service = "cfemulator"),
    (name = "CODE", service = "code"),
    (name = "CODE_KEY", fromEnvironment = "CFEMULATOR_CODE_KEY"),
  ],
);
"""


@dataclass
class DynamicHost(WorkerdHost):
    """A runner's workerd, for `capabilities.workerd.supervision`: it serves on `port`, where a
    request without a Dynamic Worker's key answers the liveness probe."""

    emulator_port: int = 0
    #: where the Dynamic Workers' code is kept (cfemulator.dynamic)
    dynamic_code_dir: Path = Path()
    #: the key their code files are sealed under (cfemulator.dynamic.seal_code), base64
    code_key: str = ""

    def write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.dynamic_code_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "runner.js").write_text(runner_source())
        config = runner_config(port=self.port, emulator_port=self.emulator_port, code_dir=self.dynamic_code_dir)
        self.config_path.write_text(config)
        return self.config_path

    def environment(self) -> dict[str, str]:
        return {"CFEMULATOR_CODE_KEY": self.code_key}
