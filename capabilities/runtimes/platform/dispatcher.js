// Sigil's dispatch Worker for the platform runtime (Workers for Platforms).
//
// Every capability is a user Worker in one dispatch namespace, named by its full name. The
// gateway calls this Worker with Sigil's shared secret, the target script's name and its
// CPU limit in internal headers; the Worker strips every `x-sigil-*` header and hands the
// request to `env.DISPATCHER.get(name, {}, {limits})`. The capability's status, headers and
// body come back as they are (streamed), with one `x-sigil-dispatch` marker the gateway
// removes: a 404 without it did not come from a capability.
//
// "Worker not found" surfaces when the Fetcher is called, not on `get()` (reference §4.3);
// it is answered 404 with `x-sigil-error: missing-code`, the loader host's word for it, so
// Sigil pages the capability in again. A capability that runs past its CPU limit makes the
// Fetcher throw "Worker exceeded CPU time limit." (spotted as the docs do, by "CPU time
// limit"); it is answered `exceeded-cpu`, naming the limit, so Sigil counts it against that
// capability alone. A failure of Cloudflare's runtime itself reaches the Fetcher as workerd's
// "internal error; reference = …": it is answered `internal-error`, so Sigil counts it against
// no capability (the runtime failed, not the code).
//
// With the edge on (SIGIL_EDGE, a plain_text binding), a caller's request (one without Sigil's
// secret header) goes to the edge (edge.js, uploaded beside this module then), which reaches
// capabilities the same way (`dispatch`).

import { sameSecret } from "./sigil-secret.js";

const SECRET_HEADER = "x-sigil-dispatch-secret";
const SCRIPT_HEADER = "x-sigil-script";
const CPU_HEADER = "x-sigil-cpu-ms";
const ERROR_HEADER = "x-sigil-error";
const DISPATCH_HEADER = "x-sigil-dispatch";
const VERSION_HEADER = "x-sigil-version";
// Cloudflare's script name rule, at most one DNS label (reference §1.5).
const SCRIPT_NAME = /^[a-z0-9_][a-z0-9_-]{0,62}$/;

function refuse(env, status, kind, message) {
  return new Response(JSON.stringify({ error: kind, message }), {
    status,
    headers: {
      "content-type": "application/json",
      [ERROR_HEADER]: kind,
      // Lets Sigil's start check tell a current dispatch Worker from a stale one.
      [VERSION_HEADER]: env.SIGIL_DISPATCHER_VERSION || "",
    },
  });
}

/** The capability `name`'s answer to `request`, marked as Sigil's engine reads it (see above). */
async function dispatch(env, name, cpuMs, request) {
  if (!SCRIPT_NAME.test(name)) {
    return refuse(env, 400, "bad-script-name", `malformed script name ${JSON.stringify(name)}`);
  }
  const options = cpuMs > 0 ? { limits: { cpuMs } } : {};
  let response;
  try {
    response = await env.DISPATCHER.get(name, {}, options).fetch(request);
  } catch (error) {
    const message = String((error && error.message) || error);
    if (message.startsWith("Worker not found")) {
      return refuse(env, 404, "missing-code", `no script ${name} in the namespace`);
    }
    if (message.startsWith("internal error")) {
      return refuse(env, 502, "internal-error", message);
    }
    if (message.includes("CPU time limit")) {
      const limit = options.limits ? `its CPU limit of ${cpuMs} ms` : "its CPU limit";
      return refuse(env, 500, "exceeded-cpu", `ran past ${limit}`);
    }
    // The capability threw.
    return refuse(env, 500, "exception", String((error && error.stack) || error));
  }
  const passed = new Response(response.body, response);
  passed.headers.set(DISPATCH_HEADER, "ok");
  return passed;
}

export default {
  async fetch(request, env, ctx) {
    if (env.SIGIL_EDGE === "true" && !request.headers.has(SECRET_HEADER)) {
      const edge = await import("./edge.js");
      const runner = { marker: DISPATCH_HEADER, reach: (route, call, cpuMs) => dispatch(env, route.slot, cpuMs, call) };
      return edge.serveEdge(request, env, ctx, runner);
    }
    if (!sameSecret(request.headers.get(SECRET_HEADER), env.SIGIL_DISPATCH_SECRET)) {
      return refuse(env, 403, "forbidden", "this Worker answers only to Sigil");
    }
    const cpuMs = Number.parseInt(request.headers.get(CPU_HEADER) || "", 10);
    const headers = new Headers(request.headers);
    for (const header of [...headers.keys()]) {
      if (header.startsWith("x-sigil-")) headers.delete(header);
    }
    return dispatch(env, request.headers.get(SCRIPT_HEADER) || "", cpuMs, new Request(request, { headers }));
  },
};
