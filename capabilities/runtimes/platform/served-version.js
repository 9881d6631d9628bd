// The entry module the platform runtime uploads in front of a capability's own (main.js)
// when it knows the capability version the code is: a redeploy replaces the namespace
// script in place, so only the answering code knows which version it is. It names it in
// every answer (x-sigil-served-version, from a plain_text binding set at upload) and
// otherwise changes nothing: the capability sees its own env, and what it throws reaches
// the dispatch Worker as before. Code that is no capability is refused while the script
// starts, as by the pool's guard (sigil-capability.js).
import { capability } from "./sigil-capability.js";

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
