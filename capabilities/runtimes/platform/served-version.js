// The entry module the platform runtime uploads in front of a capability's own (main.js)
// when it knows the capability version the code is: a redeploy replaces the namespace
// script in place, so only the answering code knows which version it is. It names it in
// every answer (x-sigil-served-version, from a plain_text binding set at upload) and
// otherwise changes nothing: the capability sees its own env, and what it throws reaches
// the dispatch Worker as before.
import * as main from "./main.js";

// Code that is no capability is refused while the script starts (so its upload fails), in
// the words the pool's guard and the loader host use.
const capability = main.default;
const USAGE = "a capability is an ES module with export default { async fetch(request, env, ctx) { ... } }";
if (capability === undefined) throw new Error(`the code has no default export: ${USAGE}`);
if (capability === null || typeof capability !== "object" || typeof capability.fetch !== "function") {
  throw new Error(`the code's default export has no fetch handler: ${USAGE}`);
}

const VERSION_HEADER = "x-sigil-served-version";

export default {
  async fetch(request, env, ctx) {
    const { SIGIL_SERVED_VERSION, ...capabilityEnv } = env;
    const response = await capability.fetch(request, capabilityEnv, ctx);
    const named = new Response(response.body, response);
    named.headers.set(VERSION_HEADER, SIGIL_SERVED_VERSION);
    return named;
  },
};
