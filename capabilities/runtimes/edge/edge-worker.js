// Sigil's edge Worker for the worker-pool runtime (`sigil-edge`): callers call capabilities
// here, and the edge (edge.js) serves them, reaching the pooled script `s-{hash6}` with a
// subrequest to its workers.dev URL carrying the guard's secret (pool/guard.js), as Sigil's
// engine does. Fetching another Worker of the account's own workers.dev zone needs the
// global_fetch_strictly_public compatibility flag (without it Cloudflare refuses with error
// 1042), with which Sigil uploads this Worker. A service binding would need this Worker
// uploaded again at every page-in, and the pool's redirects (SIGIL_POOL_REDIRECT) hand callers
// a script that answers without the guard: those calls are the origin's.
//
// Sigil itself calls this Worker only to ask which version it runs: a request carrying the
// guard's secret header is refused, naming the version (SigilWorker.probe).

import { serveEdge } from "./edge.js";

const SECRET_HEADER = "x-sigil-pool-secret";
const GUARD_HEADER = "x-sigil-guard";
const VERSION_HEADER = "x-sigil-version";

function poolRunner(env) {
  return {
    marker: GUARD_HEADER,
    reach(route, call) {
      if (env.SIGIL_POOL_REDIRECT === "true") return null;
      const url = new URL(call.url);
      const target = `https://${route.slot}.${env.SIGIL_WORKERS_SUBDOMAIN}.workers.dev${url.pathname}${url.search}`;
      const headers = new Headers(call.headers);
      headers.delete("host");
      headers.set(SECRET_HEADER, env.SIGIL_GUARD_SECRET);
      return fetch(target, { method: call.method, headers, body: call.body, redirect: "manual" });
    },
  };
}

export default {
  async fetch(request, env, ctx) {
    if (request.headers.has(SECRET_HEADER)) {
      return new Response(JSON.stringify({ error: "forbidden", message: "this Worker answers only to callers" }), {
        status: 403,
        headers: {
          "content-type": "application/json",
          "x-sigil-error": "forbidden",
          [VERSION_HEADER]: env.SIGIL_EDGE_VERSION || "",
        },
      });
    }
    return serveEdge(request, env, ctx, poolRunner(env));
  },
};
