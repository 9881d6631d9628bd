// Sigil's guard for a pooled Worker script: the entry module Sigil uploads in front of a
// capability's own module. A workers.dev URL is public, so the guard answers only requests
// that carry Sigil's shared secret, strips Sigil's headers before the capability sees the
// request, and marks every response it passes on, so the gateway can tell the capability's
// own 404 from Cloudflare's "no such Worker", and with the capability version the script is
// (a redeploy replaces it in place, so only the answering code knows which version it is).
// First, so that it runs before any module of the capability's (sigil-mask.js).
import { maskedError, useSecrets } from "./sigil-mask.js";
import { capability } from "./sigil-capability.js";
import { sameSecret } from "./sigil-secret.js";

// Not x-sigil-secret: that one is the loader host's, and a host in front may consume it.
const SECRET_HEADER = "x-sigil-pool-secret";
const GUARD_HEADER = "x-sigil-guard";
const VERSION_HEADER = "x-sigil-served-version";
const EXCEPTION_MARK = "[sigil:exception]";

export default {
  async fetch(request, env, ctx) {
    const { SIGIL_GUARD_SECRET, SIGIL_SERVED_VERSION, ...sigilAndCapabilityEnv } = env;
    const capabilityEnv = useSecrets(sigilAndCapabilityEnv);
    const version = SIGIL_SERVED_VERSION ? { [VERSION_HEADER]: SIGIL_SERVED_VERSION } : {};
    if (!sameSecret(request.headers.get(SECRET_HEADER), SIGIL_GUARD_SECRET)) {
      return new Response("Forbidden\n", { status: 403, headers: { [GUARD_HEADER]: "refused" } });
    }
    const headers = new Headers(request.headers);
    for (const name of [...headers.keys()]) {
      if (name.startsWith("x-sigil-")) headers.delete(name);
    }
    let response;
    try {
      response = await capability.fetch(new Request(request, { headers }), capabilityEnv, ctx);
    } catch (thrown) {
      // Told with its secrets masked: this answer becomes Sigil's failure record.
      const error = maskedError(thrown);
      // The guard answers for the capability, so the call's TraceItem shows no exception:
      // this line carries it to Sigil's Tail Worker (host/tail.js, EXCEPTION_MARK).
      console.error(EXCEPTION_MARK, {
        name: String((error && error.name) || "Error"),
        message: String((error && error.message) || error),
        stack: String((error && error.stack) || ""),
      });
      return new Response(JSON.stringify({ error: "exception", message: String((error && error.stack) || error) }), {
        status: 500,
        headers: { "content-type": "application/json", "x-sigil-error": "exception", [GUARD_HEADER]: "ok", ...version },
      });
    }
    const marked = new Response(response.body, response);
    marked.headers.set(GUARD_HEADER, "ok");
    if (SIGIL_SERVED_VERSION) marked.headers.set(VERSION_HEADER, SIGIL_SERVED_VERSION);
    return marked;
  },
};
