// The entry module the platform runtime uploads in front of a capability's own (main.js)
// when it knows the capability version the code is: a redeploy replaces the namespace
// script in place, so only the answering code knows which version it is. It names it in
// every answer (x-sigil-served-version, from a plain_text binding set at upload) and
// otherwise changes nothing: the capability sees its own env, and what it throws reaches
// the dispatch Worker as before. Code that is no capability is refused while the script
// starts, as by the pool's guard (sigil-capability.js). It is also the front of a capability
// with secrets, which it masks in the capability's console and in what it throws, which the
// dispatch Worker tells Sigil (sigil-mask.js).
// First, so that it runs before any module of the capability's.
import { maskedError, useSecrets } from "./sigil-mask.js";
import { capability } from "./sigil-capability.js";

const VERSION_HEADER = "x-sigil-served-version";

export default {
  async fetch(request, env, ctx) {
    const { SIGIL_SERVED_VERSION, ...sigilAndCapabilityEnv } = env;
    const capabilityEnv = useSecrets(sigilAndCapabilityEnv);
    let response;
    try {
      response = await capability.fetch(request, capabilityEnv, ctx);
    } catch (error) {
      throw maskedError(error);
    }
    if (SIGIL_SERVED_VERSION === undefined) return response;
    const named = new Response(response.body, response);
    named.headers.set(VERSION_HEADER, SIGIL_SERVED_VERSION);
    return named;
  },
};
