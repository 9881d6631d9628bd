// The capability's own module (main.js) as the entry modules Sigil uploads in front of it see
// it (the pool's guard, the platform's served-version module), uploaded beside them as
// sigil-capability.js. Code that is no capability is refused while the script starts (so its
// upload fails), in the words the loader host uses, not on every call.
import * as main from "./main.js";

export const capability = main.default;
const USAGE = "a capability is an ES module with export default { async fetch(request, env, ctx) { ... } }";
if (capability === undefined) throw new Error(`the code has no default export: ${USAGE}`);
if (capability === null || typeof capability !== "object" || typeof capability.fetch !== "function") {
  throw new Error(`the code's default export has no fetch handler: ${USAGE}`);
}
